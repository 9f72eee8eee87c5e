"""The policy decision of a tiled module's call: run untiled (with a reason), or which registered
kernel runs it (``kernel_registry``) over how many shards (the configured count or the auto policy's,
``auto_shards``).

The auto policy's answer is sought from the cheapest evidence first, each step needed only when the one
before did not settle it: the last plan's sizes while a shallow key holds (no walk of the module,
``call_plan.py``); this plan's sizes under the fast kernel's rule (every other kernel only needs more
tokens, so a call too short for the fast kernel is too short for all, and no kernel is chosen for it);
then the chosen kernel's rule.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Union

import torch
from torch import nn

from tiled_mlp.strategies.base import Strategy

from .auto_shards import AutoDecision, intermediate_size, remembered_auto_decision
from .call_plan import CallPlan, PlanSizes, plan_config, plan_holds, shallow_key
from .fast_path import fast_refused
from .kernel_registry import MAP, KernelCall, KernelChoice, available_kernels, choose_kernel, remembered_choice
from .module_forward import current_forward
from .module_snapshot import ModuleSnapshot
from .tiled_call import CallDecision
from .tiling_state import TilingState


def decide_map_call(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor, shard_forward: Callable,
                    token_inputs: Sequence[torch.Tensor]) -> CallDecision:
    """What this call of ``module`` (``state``: its tiling) on ``x`` runs (inside the strategy's gathered
    region, where a kernel's decision can read the parameters)."""
    num_tokens = x.numel() // x.shape[-1]
    # A configured count never passes a call through for its length: only the auto policy asks the sizes.
    by_policy = not isinstance(state.num_shards, int)
    # The backend is asked only where its answer can matter: a configured count tiles every call that has
    # tokens (a backend may walk the parameters to answer).
    untiled_allowed = (by_policy or num_tokens == 0) and strategy.allows_untiled_call(module)
    last = state.call_sizes
    if untiled_allowed and by_policy and last is not None and last.shallow == shallow_key(module, strategy, x):
        decision = shard_count(state, last, x, num_tokens, generic=last.generic)
        if decision.num_shards is None:
            return _untiled(decision.reason)
    plan = current_plan(module, state, strategy, x)
    if untiled_allowed and num_tokens == 0:
        return _untiled("untiled: no tokens")
    if untiled_allowed and by_policy:
        decision = shard_count(state, plan, x, num_tokens, generic=False)
        if decision.num_shards is None:
            return _untiled(decision.reason)
    only = None if state.path == "auto" else state.path
    choice = (remembered_choice(plan, MAP, only, x, token_inputs)
              or choose_kernel(MAP, KernelCall(module, x, strategy, plan.trainable, shard_forward, token_inputs, cache=plan),
                               only))
    if choice.entry is None:
        if state.path == "fast":
            raise fast_refused(module, dict(choice.declined).get("fast", "it declined"))
        if only is not None and only not in dict(choice.declined):
            raise RuntimeError(f"TiledMLP: path={only!r} names no registered kernel now (unregistered after tiling?); "
                               f"registered: {available_kernels(MAP)}. Register it again, or set tiling.path")
        raise RuntimeError(f"TiledMLP: no registered kernel runs {type(module).__name__}: {choice.describe()}")
    plan.generic = choice.entry.keeps_grad_buffers
    decision = shard_count(state, plan, x, num_tokens, plan.generic)
    reason, num_shards = decision.reason, decision.num_shards
    if untiled_allowed and num_shards is None:
        return _untiled(reason)
    if num_tokens == 0 or num_shards is None:
        num_shards = 1  # the backend needs every rank on the tiled path (same collectives)
        reason += f"; run as one shard: {strategy.name} needs every rank on the tiled path"
    return _tiled(plan, reason, choice, num_tokens, num_shards)


# Decisions are frozen and a call keeps its own only for its report: equal calls share one (its
# sentence formed once), an untiled one by its reason, a tiled one on its plan.
_UNTILED: Dict[str, CallDecision] = {}
_UNTILED_LIMIT = 512


def _untiled(reason: str) -> CallDecision:
    decision = _UNTILED.get(reason)
    if decision is None:
        if len(_UNTILED) >= _UNTILED_LIMIT:
            _UNTILED.clear()
        decision = _UNTILED[reason] = CallDecision(reason)
    return decision


def _tiled(plan: CallPlan, reason: str, choice: KernelChoice, num_tokens: int, num_shards: int) -> CallDecision:
    """The decision to run ``choice`` over ``num_shards`` shards; for a kernel that serves many calls, the
    plan's last one where everything it was formed from is the same: the sentence's parts, the kernel built
    (by identity), the sizes (the plan fixes the trainable parameters)."""
    if not getattr(choice.kernel, "serves_many_calls", False):
        # A kernel built for this one call holds what the call read (for its backward's checks): a remembered
        # decision would keep it, and those tensors, alive until the module's next call.
        return CallDecision(f"{reason}; {choice.describe()}", choice.kernel, choice.name, num_tokens, num_shards,
                            plan.trainable)
    formed_from = (reason, choice.name, choice.declined, num_tokens, num_shards)
    last = plan.last_decision
    if last is not None and last[1].kernel is choice.kernel and last[0] == formed_from:
        return last[1]
    decision = CallDecision(f"{reason}; {choice.describe()}", choice.kernel, choice.name, num_tokens, num_shards,
                            plan.trainable)
    plan.last_decision = (formed_from, decision)
    return decision


def shard_count(state: TilingState, sizes: Union[PlanSizes, CallPlan], x: torch.Tensor, num_tokens: int,
                generic: bool) -> AutoDecision:
    """The configured count, or the auto policy's (``num_shards`` None: run untiled), and why, from a
    plan's sizes (the plan itself, or the sizes a passed-through call kept)."""
    num_shards = state.num_shards
    if isinstance(num_shards, int):
        configured = _CONFIGURED.get(num_shards)
        if configured is None:
            configured = _CONFIGURED[num_shards] = AutoDecision(num_shards, f"tiled: num_shards={num_shards} as configured")
        return configured
    trainable_bytes = sizes.trainable_bytes if generic else None
    return remembered_auto_decision(num_tokens, x.shape[-1], sizes.intermediate, sizes.param_bytes, x.element_size(),
                                    trainable_bytes)


# A configured count's decision, by count (the sentence is the same at every call).
_CONFIGURED: Dict[int, AutoDecision] = {}


def current_plan(module: nn.Module, state: TilingState, strategy: Strategy, x: torch.Tensor) -> CallPlan:
    """The cached plan while its key holds, else a new one (see ``call_plan.py``)."""
    config, keep_alive = plan_config(module, strategy, x, current_forward(module, state))
    plan = state.call_plan
    if plan is None or not plan_holds(plan, config, module):
        plan = CallPlan(config, keep_alive, ModuleSnapshot(module), shallow_key(module, strategy, x),
                        strategy.trainable_params(module),
                        intermediate_size(module), strategy.param_bytes(module), list(module.named_buffers()))
        state.call_plan = plan
    return plan
