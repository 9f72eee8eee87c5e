"""Which strategy (backend) a tiled module's call runs under."""
from __future__ import annotations

import torch
from torch import nn

from tiled_mlp.strategies.base import Strategy
from tiled_mlp.strategies.resolver import resolve_strategy

from .tiling_state import TilingState

_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def inside_backward() -> bool:
    """Whether this thread is running an autograd backward (a checkpoint's recompute runs inside one)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


def module_strategy(module: nn.Module, state: TilingState) -> Strategy:
    """The fixed strategy, or "auto" resolved now (``state``: the module's tiling). Not cached across calls:
    a forward before ``fully_shard``, ``deepspeed.initialize``, a DDP or an FSDP1 wrap must not pin the
    single-device fallback (FSDP1 would then lose every gradient silently)."""
    if state.fixed_strategy is not None:
        return state.fixed_strategy
    in_backward = inside_backward()
    if in_backward and state.forward_strategy is not None:
        # A call inside a backward is a checkpoint recomputing a forward made outside it, where the
        # backend's context was visible (DDP is seen only while its forward runs): the same backend.
        return state.forward_strategy
    strategy = resolve_strategy(module, state.ancestors() if state.ancestor_refs else ())
    if not in_backward:
        # Into the state's dict: not a setting that ``TilingState.__setattr__`` checks.
        state.__dict__["forward_strategy"] = strategy
    return strategy
