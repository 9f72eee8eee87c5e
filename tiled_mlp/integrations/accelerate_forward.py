"""accelerate's mixed-precision wrapper around a model's forward: recognised exactly, and built again.

``Accelerator.prepare`` with native mixed precision (``mixed_precision="bf16"`` or ``"fp16"``) keeps the
model's forward in ``model._original_forward`` and sets ``model.forward`` to
``convert_outputs_to_fp32(autocast(forward))`` (``accelerate.utils.operations``; torch's
``autocast_decorator``): a function whose ``__wrapped__`` is a ``ConvertOutputsToFp32`` whose
``model_forward`` is torch's ``decorate_autocast`` closure over the forward. A bound forward (the class's)
is wrapped as its function and bound to the model again (``MethodType``); any other callable is wrapped
as it is. Only that exact chain is recognised: each link by its class or code object, the innermost by
identity with ``_original_forward``.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class MixedPrecisionForward:
    """What accelerate wrapped (``model._original_forward``) and the autocast it runs under."""

    inner: Callable
    autocast: Any  # a torch.autocast


@functools.lru_cache(maxsize=1)
def _autocast_code() -> types.CodeType:
    """The code object of torch's ``decorate_autocast`` (each decorated function is a new closure over it)."""
    from torch.amp.autocast_mode import autocast_decorator

    return autocast_decorator(torch.autocast("cpu", enabled=False), lambda: None).__code__


def mixed_precision_forward(model: nn.Module) -> Optional[MixedPrecisionForward]:
    """accelerate's mixed-precision chain on ``model``'s instance forward, or None if that is not what it is."""
    forward = vars(model).get("forward")
    original = vars(model).get("_original_forward")
    if forward is None or original is None:
        return None
    try:
        from accelerate.utils.operations import ConvertOutputsToFp32
    except ImportError:
        return None
    bound = isinstance(forward, types.MethodType)
    if bound and forward.__self__ is not model:
        return None
    converter = getattr(forward.__func__ if bound else forward, "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        return None
    autocasting = converter.model_forward
    if getattr(autocasting, "__code__", None) is not _autocast_code():
        return None
    cells = dict(zip(autocasting.__code__.co_freevars, (c.cell_contents for c in autocasting.__closure__ or ()), strict=True))
    wrapped = cells.get("func")
    if bound:  # accelerate wrapped the bound forward's function
        matches = (isinstance(original, types.MethodType) and original.__self__ is model
                   and original.__func__ is wrapped)
    else:
        matches = wrapped is original
    return MixedPrecisionForward(original, cells["autocast_instance"]) if matches else None


def wrap_like_prepare(model: nn.Module, inner: Callable, autocast: Any) -> None:
    """Set ``model.forward`` to what ``Accelerator.prepare`` builds around ``inner`` under ``autocast``."""
    from accelerate.utils.operations import convert_outputs_to_fp32

    model.__dict__["_original_forward"] = inner
    if isinstance(inner, types.MethodType):
        model.__dict__["forward"] = types.MethodType(convert_outputs_to_fp32(autocast(inner.__func__)), model)
    else:
        model.__dict__["forward"] = convert_outputs_to_fp32(autocast(inner))
