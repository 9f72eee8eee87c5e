"""The interface between the backend-neutral tiled core and a parallel backend.

A strategy says whether a module is its own (``claims``), rejects configurations it cannot run before
any work is done (``check_supported``), says how the module's parameters are made whole for the
shard loop and the backward recompute (``gathered``), and what a trainable parameter the call did
not use receives (``unused_grads_as_zeros``). The core returns each parameter's summed gradient
through autograd exactly once per backward, and every backend's reduction hooks take it from there.
"""
from __future__ import annotations

import contextlib
from abc import ABC
from typing import ClassVar, ContextManager, List, Sequence

import torch
from torch import nn


class UnsupportedBackendError(RuntimeError):
    """The module runs under a backend (or a backend configuration) that TiledMLP cannot tile."""


class Strategy(ABC):
    #: Registry key, also accepted as ``TiledMLP(strategy=name)``.
    name: ClassVar[str] = ""
    #: The resolver asks the highest priority first; the single-device fallback has the lowest.
    priority: ClassVar[int] = 0
    #: A trainable parameter that no shard used gets a zero gradient instead of None. Untiled, autograd
    #: leaves it None; but here it is an input of the tiled Function, reachable from the output, so a
    #: backend that waits for a gradient of every reachable parameter (DDP's reducer) needs one.
    unused_grads_as_zeros: ClassVar[bool] = False

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """Is ``module`` (the wrapped MLP, at its first forward) run by this backend? ``ancestors`` are
        the modules above it, outermost first, where known (``apply_tiled_mlp`` records them)."""
        return False

    def check_supported(self, module: nn.Module) -> None:
        """Raise a clear error for a configuration this backend cannot tile; called before any work."""

    def gathered(self, module: nn.Module) -> ContextManager:
        """Inside: the module's parameters are whole tensors usable by its forward. The default is a
        no-op: the backend's own module hooks (which fire once around the tiled call) did it."""
        return contextlib.nullcontext()

    def is_backend_hook(self, hook) -> bool:
        """Is this forward (pre-)hook on a submodule of the wrapped MLP the backend's own parameter
        handling, which ``gathered`` stands in for inside the tiled call? Then the fast kernel, which
        bypasses the submodules' ``__call__``, loses nothing by skipping it. Default: no."""
        return False

    def allows_untiled_call(self, module: nn.Module) -> bool:
        """May a call run the plain module instead of the tiled loop (no tokens, or too few for tiling
        to pay)? Only when both issue the same collectives. Default: yes (the backend's hooks sit
        around the call, not inside it)."""
        return True

    def param_bytes(self, module: nn.Module) -> int:
        """Bytes of the module's whole (gathered) parameters, for the auto shard policy."""
        return sum(p.numel() * p.element_size() for p in module.parameters())

    def trainable_params(self, module: nn.Module) -> List[torch.Tensor]:
        """The tensors whose gradients the tiled Function returns."""
        return [p for p in module.parameters() if p.requires_grad]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# The calls the core and the resolver make, by method: the arguments each must accept. ``claims`` is
# called on the class (a classmethod or staticmethod), the others on an instance.
INTERFACE = {
    "claims": ("module", "ancestors"),
    "check_supported": ("module",),
    "gathered": ("module",),
    "allows_untiled_call": ("module",),
    "param_bytes": ("module",),
    "trainable_params": ("module",),
    "is_backend_hook": ("hook",),
}
CLASS_LEVEL = ("claims",)
