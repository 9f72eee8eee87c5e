"""What the tiled loss becomes when ``torch.compile`` traces it: one op, ``tiled_mlp::linear_cross_entropy``
(``ops/``), for a plain linear head whose backend owns nothing around the call, else the eager tiled loss
behind one graph break (docs/compile.md, "Which calls trace"). Decided once where the call is traced; the rest
of the loss (the labels' shift, the denominator, the argument checks) is traced as written in ``tiled_loss``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiled_mlp.strategies.resolver import resolve_strategy, strategy_from_arg

from . import dynamo_support
from .head_call import hook_count
from .kernels.lm_head import is_plain_linear
from .kernels.vocab_parallel import SplitsHeadVocabulary
from .sharded_autograd import autocast_enabled
from .tiled_call import autograd_carries_the_call


@dataclass(frozen=True)
class LossRoute:
    as_op: bool
    reason: str


def _eager(reason: str) -> LossRoute:
    return LossRoute(False, f"eager tiled loss (a graph break): {reason}")


def decide_loss_route(lm_head: nn.Module, strategy: Any, has_group: bool) -> LossRoute:
    """Whether a call of the tiled loss on ``lm_head`` may be the op, and why (not)."""
    if has_group:
        return _eager("a sequence group (the loss is summed over ranks)")
    if not is_plain_linear(lm_head):
        return _eager(f"the head ({type(lm_head).__name__}) is not a plain nn.Linear")
    fixed = strategy_from_arg(strategy)
    backend = fixed if fixed is not None else resolve_strategy(lm_head)
    backend.check_supported(lm_head)
    if isinstance(backend, SplitsHeadVocabulary) or any(type(p).__name__ == "DTensor" for p in lm_head.parameters()):
        return _eager("the head's parameters are distributed")
    if not autograd_carries_the_call(backend):
        return _eager(f"the {backend.name} strategy gathers parameters or delivers gradients itself")
    if hook_count(lm_head):
        return _eager("the head carries hooks (they would fire around the eager loss's call of the head)")
    weight: torch.Tensor = lm_head.weight  # type: ignore[assignment]  # a plain nn.Linear's
    if autocast_enabled(weight.device.type):
        return _eager("autocast is enabled")
    return LossRoute(True, "one op, tiled_mlp::linear_cross_entropy")


@dynamo_support.decided_where_traced
def _traced_loss_route(lm_head: nn.Module, strategy: Any, has_group: bool, hooks: int) -> LossRoute:
    """``decide_loss_route``, run by Dynamo where it traces the call and kept as a constant of the graph.
    ``hooks`` is passed only so that Dynamo guards on it: a hook added to the head traces the call again."""
    return decide_loss_route(lm_head, strategy, has_group)


def traced_loss_route(lm_head: nn.Module, strategy: Any, has_group: bool) -> LossRoute:
    """The route of a traced call, with the head's hooks counted in traced code (so that Dynamo guards them)."""
    if not dynamo_support.TRACES_TILED_CALLS:
        return _eager(dynamo_support.REASON)
    return _traced_loss_route(lm_head, strategy, has_group, hook_count(lm_head))
