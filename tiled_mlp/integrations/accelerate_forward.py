"""accelerate's wrappers around a model's forward: recognised exactly, and built again.

Two wrappers: the mixed-precision one and the device hook.

``Accelerator.prepare`` with native mixed precision (``mixed_precision="bf16"`` or ``"fp16"``) keeps the
model's forward in ``model._original_forward`` and sets ``model.forward`` to
``convert_outputs_to_fp32(autocast(forward))`` (``accelerate.utils.operations``; torch's
``autocast_decorator``): a function whose ``__wrapped__`` is a ``ConvertOutputsToFp32`` whose
``model_forward`` is torch's ``decorate_autocast`` closure over the forward. A bound forward (the class's)
is wrapped as its function and bound to the model again (``MethodType``); any other callable is wrapped
as it is. Only that exact chain is recognised: each link by its class or code object, the innermost by
identity with ``_original_forward``.

``add_hook_to_module(module, hook)`` (``dispatch_model`` with hooks, ``cpu_offload``: a ``device_map``
over more than one device puts an ``AlignDevicesHook`` on the model and on its submodules) keeps the
forward in ``module._old_forward``, the hook in ``module._hf_hook``, and sets ``module.forward`` to
``functools.partial(new_forward, module)`` updated to look like the forward (its name, ``__wrapped__``).
``new_forward`` runs ``_hf_hook.pre_forward``, ``module._old_forward`` as it is at the call, then
``post_forward``: what sits in ``_old_forward`` runs inside the hook. The wrapper is recognised by its
class, the code object of accelerate's ``new_forward``, and the module it is bound to.
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


@dataclass(frozen=True)
class DeviceHookForward:
    """accelerate's hook wrapper on a module's forward (``add_hook_to_module``): the hook and what it wraps."""

    hook: Any  # an accelerate ModelHook (``module._hf_hook``)
    inner: Callable  # the forward the hook runs (``module._old_forward``)
    new_forward: Callable  # accelerate's function that the wrapper binds the module to


@functools.lru_cache(maxsize=1)
def _hook_forward_code() -> types.CodeType:
    """The code object of accelerate's ``new_forward`` (each hooked module gets a new function over it)."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    probe = nn.Module()
    add_hook_to_module(probe, ModelHook())
    wrapper = vars(probe)["forward"]
    assert isinstance(wrapper, functools.partial), "accelerate's add_hook_to_module no longer builds a partial"
    return wrapper.func.__code__


def device_hook_forward(module: nn.Module, forward: Optional[Callable] = None) -> Optional[DeviceHookForward]:
    """accelerate's hook wrapper, when ``forward`` (default: ``module``'s instance forward) is what
    ``add_hook_to_module(module, hook)`` built: ``functools.partial(new_forward, module)`` (updated to look
    like the forward it wraps), with the hook in ``module._hf_hook`` and that forward in ``module._old_forward``;
    None if it is not."""
    forward = vars(module).get("forward") if forward is None else forward
    if not isinstance(forward, functools.partial) or "_hf_hook" not in vars(module) or "_old_forward" not in vars(module):
        return None
    try:
        from accelerate.hooks import ModelHook
    except ImportError:
        return None
    if len(forward.args) != 1 or forward.args[0] is not module or forward.keywords:
        return None
    if getattr(forward.func, "__code__", None) is not _hook_forward_code():
        return None
    hook = vars(module)["_hf_hook"]
    return DeviceHookForward(hook, vars(module)["_old_forward"], forward.func) if isinstance(hook, ModelHook) else None


def hook_like_add_hook(module: nn.Module, hooked: DeviceHookForward, inner: Callable) -> Callable:
    """Put ``inner`` inside accelerate's hook on ``module``; returns the wrapper ``add_hook_to_module``
    builds around it (the caller sets it as the forward where the one there wraps something else)."""
    module.__dict__["_old_forward"] = inner
    return functools.update_wrapper(functools.partial(hooked.new_forward, module), inner)


def head_device_hook_refusal(head: nn.Module, hidden_device: Optional[torch.device] = None) -> str:
    """Why accelerate's hook on the output head stops the tiled loss ('' where it has none, or where the
    hook has nothing to do for the loss). The tiled loss runs in a call of the head whose forward is the
    loss itself, so the hook's ``pre_forward`` (moving the input to its execution device, loading
    offloaded weights) does not run around it: that is exact only for an ``AlignDevicesHook`` that keeps
    the weights in place (no offload) and whose execution device is where the hidden states already are
    (checked at each call, ``hidden_device``)."""
    hooked = device_hook_forward(head)
    if hooked is None:
        return ""
    from accelerate.hooks import AlignDevicesHook

    hook = hooked.hook
    fix = ("Give lm_head the device of the model's final norm in the device_map and keep it on that device (not "
           "offloaded), or leave the tiled loss off")
    if type(hook) is not AlignDevicesHook or hook.offload:
        return (f"{type(head).__name__} carries accelerate's device hook {hook!r} (dispatch_model, cpu_offload), which "
                "would load its weights around its call; the tiled loss reads them inside a call of its own that this "
                f"hook does not run around. {fix}")
    if hidden_device is not None and hook.execution_device is not None and (
            torch.device(hook.execution_device) != hidden_device):
        return (f"{type(head).__name__} carries accelerate's device hook, which would move the hidden states to "
                f"{hook.execution_device}; they are on {hidden_device}, and the tiled loss runs in a call of the head "
                f"that this hook does not run around. {fix}")
    return ""
