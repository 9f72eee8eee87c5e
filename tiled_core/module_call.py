"""A tiled module's call: its arguments become the tiled call's inputs (``TiledMLP.tiled_inputs``),
and ``MapSite`` is what the one tiled call (``tiled_call``) asks of a token-wise module."""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from tiled_mlp.strategies.base import Strategy

from .buffer_guard import buffers_kept
from .call_decision import decide_map_call
from .module_forward import adopt_instance_forward, base_forward, original_forward
from .module_strategy import module_strategy
from .shard_plan import ShardPlan
from .sharded_autograd import ShardedRun, sharded_apply
from .tiled_call import CallDecision, tiled_call
from .tiling_state import TilingState, tiling_of
from .validation import check_input


class TiledInputs(NamedTuple):
    """How one call's arguments enter the tiled call (``TiledMLP.tiled_inputs`` returns it)."""

    hidden_states: torch.Tensor  # ``[..., tokens, hidden]``, sharded over its tokens
    # Other token-wise inputs of any dtype (``[..., tokens, ...]``, the leading dims of the hidden
    # states), sliced like them and passed after them to each shard (a MoE block's routing).
    token_inputs: Sequence[torch.Tensor] = ()
    # Whether the hidden states must match the module's input width (a module with input projections).
    check_hidden: bool = True


def module_forward(module: nn.Module, *args, **kwargs) -> torch.Tensor:
    """The forward of every tiled class (``TiledForward`` calls it)."""
    state = tiling_of(module)
    if state.shard_depth:
        # Called from inside one of its own shards: an instance forward wrapping the tiled forward
        # (accelerate's hooks: ``old = m.forward; m.forward = wrapper(old)``) reaches here; the shard
        # computes the module's own forward.
        return base_forward(module)(module, *args, **kwargs)
    adopt_instance_forward(module, state)
    return tiled_call(MapSite(module, state, module.tiled_inputs(*args, **kwargs)))  # type: ignore[operator]


class MapSite:
    """A token-wise module's side of ``tiled_call``: a ``sharded_apply`` over its hidden states."""

    def __init__(self, module: nn.Module, state: TilingState, inputs: TiledInputs):
        x = inputs.hidden_states
        # The configured shard count needs no check here: the state checks it wherever it is set, unpickling
        # included (``TilingState``).
        check_input(x, module if inputs.check_hidden else None)
        self.owner = module
        self.state = state
        self.x = x
        self.token_inputs = inputs.token_inputs
        self.flat_token_inputs = _flat_token_inputs(x, inputs.token_inputs) if inputs.token_inputs else ()
        self.grad_accum_dtype = state.grad_accum_dtype
        self.shard_forward = functools.partial(original_forward, module)

    def strategy(self) -> Strategy:
        strategy = module_strategy(self.owner, self.state)
        strategy.check_supported(self.owner)
        self.state.__dict__["last_strategy"] = strategy  # a report field (see ``record``)
        return strategy

    def decide(self, strategy: Strategy) -> CallDecision:
        return decide_map_call(self.owner, self.state, strategy, self.x, self.shard_forward, self.flat_token_inputs)

    def untiled(self, decision: CallDecision) -> torch.Tensor:
        # Nothing to split, or too short for tiling to lower the peak: the plain module (only where the
        # backend allows it: the same collectives as a tiled call).
        return self.shard_forward(self.x, *self.token_inputs)

    def run(self, run: ShardedRun) -> torch.Tensor:
        call_plan = self.state.call_plan
        assert call_plan is not None, "a tiled call has a plan"
        buffers = call_plan.named_buffers
        if not buffers:  # most MLPs: no guard to enter (a context costs a microsecond of a short call)
            return sharded_apply(self.x, run)
        with buffers_kept(type(self.owner).__name__, buffers):
            return sharded_apply(self.x, run)

    def record(self, decision: CallDecision, plan: Optional[ShardPlan]) -> None:
        state = self.state
        # Written into the state's dict: these fields are the call's report, never the configuration
        # that ``TilingState.__setattr__`` checks, and a short call spends microseconds on such writes.
        fields = state.__dict__
        call_plan = state.call_plan
        if plan is None:
            # Only the plan's sizes are kept (``PlanSizes``): no tensor of the module is held by the cache
            # of its short calls.
            if call_plan is not None:
                fields["call_sizes"], fields["call_plan"] = call_plan.sizes(), None
            path, num_shards = "untiled", 1
        else:
            assert call_plan is not None, "a tiled call has a plan"
            fields["call_sizes"] = call_plan.sizes()
            path, num_shards = decision.kernel_name, plan.num_shards
        fields["last_path"], fields["last_num_shards"], fields["last_reason"] = path, num_shards, decision.reason


def _flat_token_inputs(x: torch.Tensor, token_inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each token input as ``[tokens, ...]`` (a view where its layout allows), checked against ``x``'s tokens."""
    lead = x.shape[:-1]
    flat = []
    for token_input in token_inputs:
        if tuple(token_input.shape[:len(lead)]) != tuple(lead):
            raise ValueError(f"a sharded input of shape {tuple(token_input.shape)} does not share the leading (token) dims "
                             f"{tuple(lead)} of the hidden states {tuple(x.shape)}")
        flat.append(token_input.reshape(-1, *token_input.shape[len(lead):]))
    return flat
