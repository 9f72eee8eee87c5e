"""accelerate's wrappers around a model's forward: recognised exactly (each link by its class or code object, the
innermost by identity), and built again.

``Accelerator.prepare`` with native mixed precision keeps the forward in ``model._original_forward`` and sets
``model.forward`` to ``convert_outputs_to_fp32(autocast(forward))``: a function whose ``__wrapped__`` is a
``ConvertOutputsToFp32`` whose ``model_forward`` is torch's ``decorate_autocast`` closure over the forward (a bound
forward is wrapped as its function and bound again). ``add_hook_to_module(module, hook)`` keeps the forward in
``module._old_forward``, the hook in ``module._hf_hook``, and sets ``module.forward`` to
``functools.partial(new_forward, module)``, which runs ``_old_forward`` as it is at the call.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class MixedPrecisionForward:
    inner: Callable  # what accelerate wrapped (``model._original_forward``)
    autocast: Any  # the torch.autocast it runs under


@functools.lru_cache(maxsize=1)
def _autocast_code() -> types.CodeType:
    from torch.amp.autocast_mode import autocast_decorator

    return autocast_decorator(torch.autocast("cpu", enabled=False), lambda: None).__code__


def mixed_precision_forward(model: nn.Module) -> Optional[MixedPrecisionForward]:
    forward, original = vars(model).get("forward"), vars(model).get("_original_forward")
    if forward is None or original is None:
        return None
    try:
        from accelerate.utils.operations import ConvertOutputsToFp32
    except ImportError:
        return None
    bound = isinstance(forward, types.MethodType)
    converter = getattr(forward.__func__ if bound else forward, "__wrapped__", None)
    autocasting = getattr(converter, "model_forward", None)
    if not isinstance(converter, ConvertOutputsToFp32) or getattr(autocasting, "__code__", None) is not _autocast_code():
        return None
    cells = inspect.getclosurevars(converter.model_forward).nonlocals
    if bound:  # accelerate wrapped the bound forward's function
        matches = (forward.__self__ is model and isinstance(original, types.MethodType) and original.__self__ is model
                   and original.__func__ is cells["func"])
    else:
        matches = cells["func"] is original
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
    hook: Any  # an accelerate ModelHook (``module._hf_hook``)
    inner: Callable  # the forward the hook runs (``module._old_forward``)
    new_forward: Callable  # accelerate's function that the wrapper binds the module to


@functools.lru_cache(maxsize=1)
def _hook_forward_code() -> types.CodeType:
    from accelerate.hooks import ModelHook, add_hook_to_module

    probe = nn.Module()
    add_hook_to_module(probe, ModelHook())
    return vars(probe)["forward"].func.__code__


def device_hook_forward(module: nn.Module, forward: Optional[Callable] = None) -> Optional[DeviceHookForward]:
    """accelerate's hook wrapper, when ``forward`` (default: ``module``'s instance forward) is what
    ``add_hook_to_module(module, hook)`` built."""
    forward = vars(module).get("forward") if forward is None else forward
    hook = vars(module).get("_hf_hook")
    if not isinstance(forward, functools.partial) or hook is None or "_old_forward" not in vars(module):
        return None
    try:
        from accelerate.hooks import ModelHook
    except ImportError:
        return None
    if len(forward.args) != 1 or forward.args[0] is not module or forward.keywords or not isinstance(hook, ModelHook):
        return None
    if getattr(forward.func, "__code__", None) is not _hook_forward_code():
        return None
    return DeviceHookForward(hook, vars(module)["_old_forward"], forward.func)


def hook_like_add_hook(module: nn.Module, hooked: DeviceHookForward, inner: Callable) -> Callable:
    """Put ``inner`` inside accelerate's hook on ``module``; returns the wrapper ``add_hook_to_module``
    builds around it."""
    module.__dict__["_old_forward"] = inner
    return functools.update_wrapper(functools.partial(hooked.new_forward, module), inner)


def head_device_hook_refusal(head: nn.Module, hidden_device: Optional[torch.device] = None) -> str:
    """Why accelerate's hook on the output head stops the tiled loss ('' where nothing does). The hook's
    ``pre_forward`` does not run around the loss: exact only for an ``AlignDevicesHook`` that keeps the weights in
    place and whose execution device is where the hidden states already are (checked at each call)."""
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
