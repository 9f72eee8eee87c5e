"""A tiled module's one added attribute, ``module.tiling``: the tiling configuration and the last call's report.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from .kernel_registry import MAP, available_kernels
from .shard_plan import NumShards, check_num_shards

STATE_ATTR = "tiling"


def check_grad_accum_dtype(grad_accum_dtype: Optional[torch.dtype]) -> None:
    if grad_accum_dtype is not None and not (isinstance(grad_accum_dtype, torch.dtype) and grad_accum_dtype.is_floating_point):
        raise TypeError(f"grad_accum_dtype must be a floating torch.dtype or None, got {grad_accum_dtype!r}")


def check_config(num_shards: NumShards, path: str, grad_accum_dtype: Optional[torch.dtype],
                 use_fused_kernel: bool = True) -> None:
    check_num_shards(num_shards)
    paths = ("auto", *available_kernels(MAP))  # "fast", "generic" and every registered map kernel
    if path not in paths:
        raise ValueError(f"path must be one of {paths}, got {path!r}")
    check_grad_accum_dtype(grad_accum_dtype)
    if not isinstance(use_fused_kernel, bool):  # a truthy string ("no") would turn the kernel on
        raise TypeError(f"use_fused_kernel must be True or False, got {use_fused_kernel!r}")


_CHECKED = ("num_shards", "path", "grad_accum_dtype", "use_fused_kernel")
_PLANNED = ("path", "use_fused_kernel")  # what the call plan rests on: setting one drops the plan


@dataclass
class TilingState:
    """The tiling of one module (``module.tiling``): ``TiledMLP``'s arguments (``fixed_strategy``: None for
    "auto"), and what the last call ran (``last_path``: a kernel's name or "untiled", its shard count, the
    ``Strategy`` it resolved, and why)."""

    num_shards: NumShards = "auto"
    path: str = "auto"
    grad_accum_dtype: Optional[torch.dtype] = None
    use_fused_kernel: bool = True
    fixed_strategy: Optional[Any] = None
    last_path: Optional[str] = None
    last_num_shards: Optional[int] = None
    last_strategy: Optional[Any] = None
    # Why the last call ran as it did, in words (the auto policy's decision, or the path's reason).
    last_reason: Optional[str] = None
    # The strategy the last call outside a backward resolved: a checkpoint's recompute inside the
    # backward, where the backend's context (DDP's running forward) is gone, uses it again.
    forward_strategy: Optional[Any] = field(default=None, repr=False, compare=False)
    # How deep this module is inside one of its own shards' instance forwards (see
    # ``TiledMLP._tiled_forward``): a wrapper of the tiled forward called from there runs the plain one.
    shard_depth: int = field(default=0, repr=False, compare=False)
    # Weak references to the modules above (outermost first), recorded by apply_tiled_mlp so that
    # "auto" sees a backend that wraps an ancestor. Weak: no reference cycle, nothing to save.
    ancestor_refs: tuple = ()
    # A forward another library installed on the instance before tiling (accelerate's device hooks):
    # each shard runs it, and untiling puts it back.
    instance_forward: Optional[Any] = field(default=None, repr=False)
    # What the calls decided, and what that rests on (``tiled_call.MapPlan``).
    call_plan: Optional[Any] = field(default=None, repr=False, compare=False)
    # The strategy "auto" resolved where no process group is initialised, and the registrations it was
    # resolved among (``tiled_call.module_strategy``).
    local_strategy: Optional[Any] = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # ``mlp.tiling.path = "bogus"`` is refused, not run as if it were another path.
        if name in _CHECKED:
            config: Dict[str, Any] = {key: getattr(self, key) for key in _CHECKED}
            config[name] = value
            check_config(**config)
        if name in _PLANNED:
            self.__dict__["call_plan"] = None
        object.__setattr__(self, name, value)

    def set_ancestors(self, ancestors: Sequence[nn.Module]) -> None:
        self.ancestor_refs = tuple(weakref.ref(m) for m in ancestors)

    def ancestors(self) -> List[nn.Module]:
        return [m for m in (r() for r in self.ancestor_refs) if m is not None]

    def __getstate__(self):
        # pickle, deepcopy and torch.save(model): weak references cannot be saved, and a copy must not
        # point at the original's ancestors; the cached decision is re-made on the copy. The strategies the
        # last calls resolved belong to the runtime they ran in (DDP's holds its process group, which cannot
        # be saved): the copy resolves its own.
        state = dict(self.__dict__)
        state["ancestor_refs"] = ()
        state["call_plan"] = None
        state["local_strategy"] = None
        state["forward_strategy"] = None
        state["last_strategy"] = None
        state["shard_depth"] = 0
        return state

    def __setstate__(self, state: dict) -> None:
        # A saved state is checked as a set one is (a path is checked at its call instead: its kernel may be
        # registered only after the state is loaded).
        check_num_shards(state.get("num_shards", "auto"))
        self.__dict__.update(state)

    def copied(self) -> TilingState:
        new = object.__new__(TilingState)
        new.__setstate__(self.__getstate__())
        return new


def tiling_of(module: nn.Module) -> TilingState:
    return module.__dict__[STATE_ATTR]
