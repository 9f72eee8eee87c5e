"""Whether a module may take the gated fast kernel, whatever the call: decided from what the forward is
(``gated_forms``) and the module's structure (``gated_spec``), never by running it, once per call plan.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from torch import nn

from .gated_forms import known_form
from .gated_spec import GatedMLPSpec, no_hook_is_backend, structural_spec
from .module_forward import forward_function, is_tiled

UNKNOWN_FORWARD = ("its forward is not one the fast kernel is known to compute (a known library body, or a class "
                   "declared with register_gated_mlp)")


def structural_decision(module: nn.Module, forward_fn: Optional[Callable], is_backend_hook: Callable = no_hook_is_backend,
                        mixin: Optional[type] = None) -> Tuple[Optional[GatedMLPSpec], str]:
    """The spec when ``forward_fn`` (what the module's forward runs) is proven to compute a gated form on this
    module's structure, else (None, why not); ``mixin``: the tiling class, where the module is not tiled yet."""
    unfit = getattr(mixin or type(module), "tiled_no_fast_path", "")  # a tiling class's own refusal (TiledNorm's)
    if unfit:
        return None, unfit
    form = known_form(forward_fn)
    if form is None:
        return None, UNKNOWN_FORWARD
    return structural_spec(module, form, is_backend_hook)


class FastPathRefused(ValueError):
    """``path="fast"`` asked of a module the fast kernel cannot run."""


def fast_refused(module: nn.Module, why_not: str) -> FastPathRefused:
    return FastPathRefused(f"path='fast' cannot apply to {type(module).__name__}: {why_not}; use path='auto'")


def fast_path_problem(mixin: type, mlp: nn.Module, is_backend_hook: Callable = no_hook_is_backend) -> str:
    """Why the fast kernel could never run ``mlp`` (tiled or not), whatever the call ("" when it may)."""
    if is_tiled(mlp):
        forward = forward_function(mlp)
    else:  # not tiled yet: an instance forward here is another library's (accelerate's hooks)
        forward = None if "forward" in mlp.__dict__ else type(mlp).forward
    return structural_decision(mlp, forward, is_backend_hook, mixin)[1]
