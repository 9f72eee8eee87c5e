"""The one tiled call: every tiled module and the tiled loss run through ``tiled_call``.

    strategy  ->  gathered region  ->  decision  ->  shard plan  ->  map or reduce run

1. **strategy**: the backend the call runs under (``CallSite.strategy``: resolved for a module at
   every call, since a model is usually wrapped by its backend after it was tiled).
2. **gathered region**: the strategy's ``gathered`` context around everything below (a ZeRO-3
   parameter is whole inside it): never one gather per shard.
3. **decision** (``CallSite.decide``): run untiled, with a reason, or a kernel from the registry
   (``kernel_registry.choose_kernel``) and a shard count.
4. **shard plan**: the token slices (``shard_plan.make_shard_plan``).
5. **run**: the sharded autograd Function of the caller's shape (``CallSite.run``: ``sharded_apply``,
   a token-wise map, or ``sharded_reduce``, a sum over shards), with the strategy's gradient delivery.

A caller (``module_call.MapSite`` for tiled modules, ``tiled_loss.LossSite`` for the loss) says only
what differs: how its strategy is found, how it decides, which Function runs, what it records.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence

import torch
from torch import nn

from tiled_mlp.strategies.base import Strategy

from .shard_plan import ShardPlan, make_shard_plan
from .sharded_autograd import ShardedRun


@dataclass(frozen=True)
class CallDecision:
    """One call's decision, made once inside the gathered region: no kernel means run untiled."""

    reason: str
    kernel: Optional[Any] = None  # a ``ShardKernel`` (map) or ``ReduceKernel`` (reduce)
    kernel_name: str = "untiled"
    num_tokens: int = 0
    num_shards: Optional[int] = None
    trainable: Sequence[torch.Tensor] = ()  # the parameters owed a gradient
    # The runs made for this decision, by the call settings they also depend on (``_run_for``).
    runs: Dict[tuple, ShardedRun] = field(default_factory=dict, compare=False, repr=False)


class CallSite(Protocol):
    """What differs between the callers of ``tiled_call``."""

    #: The module whose backend gathers the parameters (the tiled module; the loss's head).
    owner: nn.Module
    grad_accum_dtype: Optional[torch.dtype]

    def strategy(self) -> Strategy:
        """The backend this call runs under, checked as supported."""

    def decide(self, strategy: Strategy) -> CallDecision:
        """Untiled with a reason, or a kernel and a shard count (inside the gathered region)."""

    def untiled(self, decision: CallDecision) -> torch.Tensor:
        """The call run as the plain module."""

    def run(self, run: ShardedRun) -> torch.Tensor:
        """The sharded autograd Function of this caller's shape over ``run``."""

    def record(self, decision: CallDecision, plan: Optional[ShardPlan]) -> None:
        """What the call leaves for its report (``module.tiling.last_*``)."""


def membership(tensors: Sequence[torch.Tensor], chosen: Sequence[torch.Tensor]) -> List[bool]:
    ids = {id(t) for t in chosen}
    return [id(t) in ids for t in tensors]


# The base class's no-op defaults, as defined (a later patch of ``Strategy.gathered`` is then not
# mistaken for the no-op, and is entered like any override).
_BASE_GATHERED = Strategy.gathered
_BASE_DELIVER_GRADS = Strategy.deliver_grads


def _is_base(method: Any, base_function: Any) -> bool:
    """Whether a strategy's bound ``method`` is the base class's default (by the function object: a
    subclass or an instance that overrides it is not)."""
    return getattr(method, "__func__", None) is base_function


def autograd_carries_the_call(strategy: Strategy) -> bool:
    """Whether the strategy neither gathers parameters around a call nor delivers gradients itself (its
    ``gathered`` and ``deliver_grads`` are the base class's no-ops): autograd alone carries a call's tensors
    and gradients, as for any op (what a custom op needs, ``compiled_route``)."""
    return _is_base(strategy.gathered, _BASE_GATHERED) and _is_base(strategy.deliver_grads, _BASE_DELIVER_GRADS)


def tiled_call(site: CallSite) -> torch.Tensor:
    """Run one tiled call of ``site``: strategy, gathered region, decision, shard plan, run."""
    strategy = site.strategy()
    gathered = strategy.gathered
    if _is_base(gathered, _BASE_GATHERED):
        # The base class's no-op (a single device, DDP): no context to enter, here or around the backward.
        return _decide_and_run(site, strategy, None)
    with gathered(site.owner):
        return _decide_and_run(site, strategy, functools.partial(gathered, site.owner))


def _decide_and_run(site: CallSite, strategy: Strategy, gathered: Optional[Callable[[], ContextManager]]) -> torch.Tensor:
    """The decision, the shard plan and the run of one call, inside the strategy's gathered region;
    ``gathered`` enters it again around the backward (None: a no-op)."""
    decision = site.decide(strategy)
    kernel = decision.kernel
    if kernel is None:
        site.record(decision, None)
        return site.untiled(decision)
    deliver_grads = strategy.deliver_grads
    deliver = None if _is_base(deliver_grads, _BASE_DELIVER_GRADS) else deliver_grads
    # A kernel that computes on local tensors sees distributed parameters through the strategy's view.
    view = strategy.local_view(site.owner, kernel.params) if getattr(kernel, "runs_on_local_view", False) else None
    if view is not None and view.why_not:
        raise RuntimeError(f"{decision.kernel_name} kernel chosen for {type(site.owner).__name__}, whose local view "
                           f"declines it: {view.why_not}")
    run = _run_for(decision, site, strategy, gathered, deliver, view)
    out = site.run(run)
    site.record(decision, run.plan)
    return out


def _run_for(decision: CallDecision, site: CallSite, strategy: Strategy, gathered: Optional[Callable[[], ContextManager]],
             deliver: Optional[Callable], view: Any) -> ShardedRun:
    """The run of ``decision``. Where the strategy brings nothing made for this call (no gathered region, no
    gradient delivery, no local view: a single device, DDP), the run an earlier call of the same decision made
    with the same settings: a run holds nothing of a call, and a decision is reused only while its plan holds
    and everything it was formed from is the same (``call_decision._tiled``)."""
    kernel = decision.kernel
    assert kernel is not None and decision.num_shards is not None, "a decision with a kernel has a shard count"
    swaps = strategy.swaps_param_storage(site.owner)
    key = (site.grad_accum_dtype, strategy.unused_grads_as_zeros, swaps)
    reusable = gathered is None and deliver is None and view is None
    if reusable:
        run = decision.runs.get(key)
        if run is not None:
            return run
    run = ShardedRun(
        kernel=kernel,
        plan=make_shard_plan(decision.num_tokens, decision.num_shards),
        gathered=gathered,
        grad_accum_dtype=site.grad_accum_dtype,
        # A kernel that provably draws no random numbers (the gated one) has none to replay.
        replay_rng=getattr(kernel, "replays_rng", True),
        param_mask=membership(kernel.params, decision.trainable),
        zeros_for_unused=strategy.unused_grads_as_zeros,
        deliver_grads=deliver,
        params_swap_storage=swaps,
        local_view=view,
    )
    if reusable:
        decision.runs[key] = run
    return run
