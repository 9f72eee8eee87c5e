"""Whether a call may take the gated fast kernel: decided from what the forward is (``gated_forms``) and the
module's structure (``gated_spec``), never by running it, once per call plan.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .gated_forms import known_form_and_body
from .gated_spec import GatedMLPSpec, no_hook_is_backend, structural_spec
from .module_forward import forward_function, is_tiled
from .sharded_autograd import autocast_enabled


def decide_fast_path(module: nn.Module, forward_fn: Optional[Callable], x: torch.Tensor,
                     is_backend_hook) -> Tuple[Optional[GatedMLPSpec], str]:
    spec, why_not = structural_decision(module, forward_fn, is_backend_hook)
    if spec is None:
        return None, why_not
    if autocast_enabled(x.device.type):
        return None, "autocast is enabled (the fast kernel computes in the weights' dtype)"
    weight = spec.down.weight
    if x.dtype != weight.dtype:
        # The module may cast its input (or fail); the generic path does exactly what it does.
        return None, f"the input is {x.dtype} but the weights are {weight.dtype}"
    if x.device != weight.device:
        return None, f"the input is on {x.device} but the weights are on {weight.device}"
    return spec, ""


def structural_decision(module: nn.Module, forward_fn: Optional[Callable],
                        is_backend_hook: Callable = no_hook_is_backend) -> Tuple[Optional[GatedMLPSpec], str]:
    form, body = known_form_and_body(forward_fn)
    if form is None:
        return None, UNKNOWN_FORWARD
    return structural_spec(module, form, is_backend_hook, None if body is None else (forward_fn, body))


UNKNOWN_FORWARD = ("its forward is not one the fast kernel is known to compute (a known library body, or a class "
                   "declared with register_gated_mlp)")


class FastPathRefused(ValueError):
    """``path="fast"`` asked of a module the fast kernel cannot run."""


def fast_refused(module: nn.Module, why_not: str) -> FastPathRefused:
    return FastPathRefused(f"path='fast' cannot apply to {type(module).__name__}: {why_not}; use path='auto'")


def fast_path_problem(mixin: type, mlp: nn.Module, is_backend_hook: Callable = no_hook_is_backend) -> str:
    """Why the fast kernel could never run ``mlp`` (tiled or not), whatever the call ("" when it may)."""
    unfit = getattr(mixin, "tiled_no_fast_path", "")
    if unfit:
        return unfit
    if is_tiled(mlp):
        forward = forward_function(mlp)
    else:  # not tiled yet: an instance forward here is another library's (accelerate's hooks)
        forward = None if "forward" in mlp.__dict__ else type(mlp).forward
    return structural_decision(mlp, forward, is_backend_hook)[1]
