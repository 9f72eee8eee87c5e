"""Checkpoint offload on a model: its checkpointed layers, found by class (torch's ``checkpoint_wrapper``, else HF's
``GradientCheckpointingLayer`` with checkpointing on), keep their inputs in host memory until backward."""
from __future__ import annotations

import weakref
from typing import Any, Callable, List

from torch import nn

from tiled_mlp.core.checkpoint_offload import CheckpointOffload

from .seams import transformers_internals

NO_LAYERS_ERROR = (
    "checkpoint offload: {model} has no checkpointed layer. Turn layer checkpointing on first "
    "(model.gradient_checkpointing_enable(), or torch's checkpoint_wrapper around each decoder layer): the "
    "offload moves each checkpointed layer's saved input to host memory, and without checkpointing there is none."
)


def checkpointed_layers(model: nn.Module) -> List[nn.Module]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrappers: List[nn.Module] = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    if wrappers:
        return wrappers
    try:
        layer_class = transformers_internals.checkpointing_layer_class()
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, layer_class) and m.gradient_checkpointing]


def apply_checkpoint_offload(model: nn.Module) -> CheckpointOffload:
    """Offload the input of every checkpointed layer but the last; ``.remove()`` on the handle undoes it."""
    layers = checkpointed_layers(model)
    if not layers:
        raise ValueError(NO_LAYERS_ERROR.format(model=type(model).__name__))
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if isinstance(layers[0], CheckpointWrapper) or not transformers_internals.checkpoint_wraps_module_hooks():
        return CheckpointOffload(layers)
    # An HF layer that checkpoints in ``__call__`` wraps its own hooks, which would see none of the saved inputs:
    # its checkpoint function is called through a module whose hooks sit outside the checkpoint.
    sites = [_CheckpointCall(layer._gradient_checkpointing_func) for layer in layers]
    for layer, site in zip(layers, sites, strict=True):
        setattr(layer, "_gradient_checkpointing_func", site.checkpoint_function)  # noqa: B010 - an HF instance attribute
    # Held weakly: the layers hold the sites, whose hooks hold the offload and so this function.
    originals = [(weakref.ref(layer), site.checkpoint) for layer, site in zip(layers, sites, strict=True)]

    def restore() -> None:
        for layer_ref, checkpoint in originals:
            layer = layer_ref()
            if layer is not None:
                setattr(layer, "_gradient_checkpointing_func", checkpoint)  # noqa: B010

    return CheckpointOffload(sites, on_remove=restore)


class _CheckpointCall(nn.Module):
    """Calls an HF layer's checkpoint function through this module's hooks (``checkpoint_function``)."""

    def __init__(self, checkpoint: Any) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def forward(self, *args: Any, function: Any) -> Any:
        return self.checkpoint(function, *args)

    def checkpoint_function(self, function: Any, *args: Any) -> Any:
        return self(*args, function=function)


# Instance attributes transformers sets while turning checkpointing on: the input-gradient hooks'
# handles (``enable_input_require_grads``, which replaces a list the user's own call left there), and
# each checkpointed module's flag and checkpoint function.
_ATTRIBUTES_SET = ("_require_grads_hooks", "_require_grads_hook", "gradient_checkpointing",
                   "_gradient_checkpointing_func")
_ABSENT = object()


def checkpointing_on(model: nn.Module) -> Callable[[], None]:
    """Hugging Face's non-reentrant layer checkpointing on ``model``; returns what turns it off and takes off exactly
    the hooks and attributes it added (the user's own stay)."""
    hooks_before = {key for module in model.modules() for key in module._forward_hooks}  # keys: one counter process-wide
    attributes_before = [(module, name, vars(module).get(name, _ABSENT)) for module in model.modules()
                         for name in _ATTRIBUTES_SET]
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers after 5.19 (the old name warns there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
    else:
        raise ValueError(f"checkpoint offload: {type(model).__name__} has no checkpointed layer and no "
                         "gradient_checkpointing_enable(); wrap its layers in torch's checkpoint_wrapper first")
    added = [(module, key) for module in model.modules() for key in module._forward_hooks if key not in hooks_before]

    def checkpointing_off() -> None:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()  # type: ignore[operator]
        for module, key in added:
            for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
                hooks.pop(key, None)
        for module, name, value in attributes_before:
            if value is _ABSENT:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value

    return checkpointing_off
