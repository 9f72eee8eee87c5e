"""Whether a call may take the gated fast kernel, and the key of what that (and every other answer a
call caches, ``call_plan.py``) rests on.

The decision rests on the module's structure (its parameters, buffers, submodules and hooks), its
training mode (a forward may drop out only in training), the weights' and the input's dtype and
device, the plain settings on the module (a ``self.scale = 2.0`` the forward reads), and autocast.
All of that is the key; a probe of the real forward runs only when the key changes.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .autocast_state import autocast_enabled
from .gated_spec import GatedMLPSpec, probe_forward, structural_spec

# Plain settings a forward may read (``self.scale = 2.0``, ``GELU.approximate``); the tiling state
# and every tensor, module or dict are none of these types.
_SETTING_TYPES = frozenset({bool, int, float, str, type(None)})


def _entries(registry: dict) -> tuple:
    return tuple((k, id(t), t.dtype, t.device, t.requires_grad) if t is not None else (k, None)
                 for k, t in registry.items())


def module_key(module: nn.Module, x: torch.Tensor) -> Tuple[tuple, tuple]:
    """(key, keep_alive): the key compares identities, so the objects it names are kept alive with it
    (a freed object's id could be taken by a new one). Hooks are keyed by their handle ids, which are
    never reused. It runs at every call: plain loops over each submodule's own dicts, nothing more."""
    objects: list = []
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        d = sub.__dict__
        params, buffers = d["_parameters"], d["_buffers"]
        objects.append(sub)
        objects.extend(params.values())
        objects.extend(buffers.values())
        parts.append((name, id(sub), "forward" in d,
                      tuple(d["_forward_hooks"]), tuple(d["_forward_pre_hooks"]),
                      tuple(d["_backward_hooks"]), tuple(d["_backward_pre_hooks"]),
                      tuple((k, v) for k, v in d.items() if type(v) in _SETTING_TYPES),
                      _entries(params), _entries(buffers)))
    return (tuple(parts), x.dtype, x.device, autocast_enabled(x.device.type)), tuple(objects)


def decide_fast_path(module: nn.Module, forward_fn: Callable, x: torch.Tensor,
                     is_backend_hook) -> Tuple[Optional[GatedMLPSpec], str]:
    """(the spec, "") when the fast kernel computes exactly what ``forward_fn`` computes on ``x``,
    else (None, why not)."""
    spec, why_not = structural_spec(module, is_backend_hook)
    if spec is not None:
        why_not = _call_problem(spec, x) or probe_forward(forward_fn, spec, x)
        spec = None if why_not else spec
    return spec, why_not


def _call_problem(spec: GatedMLPSpec, x: torch.Tensor) -> str:
    """What about this call (not the module) rules the fast kernel out."""
    if autocast_enabled(x.device.type):
        return "autocast is enabled (the fast kernel computes in the weights' dtype)"
    weight = spec.down.weight
    if x.dtype != weight.dtype:
        # The module may cast its input (or fail); the generic path does exactly what it does.
        return f"the input is {x.dtype} but the weights are {weight.dtype}"
    if x.device != weight.device:
        return f"the input is on {x.device} but the weights are on {weight.device}"
    return ""
