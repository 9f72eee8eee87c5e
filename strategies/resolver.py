"""Picks the strategy for a module: the highest-priority registered class that claims it."""
from __future__ import annotations

from typing import Any, Sequence, Union

from torch import nn

from .base import Strategy
from .registry import get_strategy, strategies_by_priority

StrategyArg = Union[str, Strategy]


def resolve_strategy(module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> Strategy:
    for cls in strategies_by_priority():
        if cls.claims(module, ancestors):
            return cls()
    raise RuntimeError("no registered strategy claims the module (the single_device fallback was unregistered?)")


def sums_over_sequence_ranks(module: nn.Module, group: Any = None) -> bool:
    """Does any registered backend, as set up in this process, sum ``module``'s model's gradients over a
    sequence-parallel group's ranks (``Strategy.sums_over_sequence_ranks``)? Every registered backend is
    first asked to check that it can carry a loss split across ``group`` (``Strategy.check_sequence_group``),
    each one whatever the others answer."""
    classes = strategies_by_priority()
    if group is not None:
        for cls in classes:
            cls.check_sequence_group(module, group)
    return any([cls.sums_over_sequence_ranks(module) for cls in classes])


def strategy_from_arg(strategy: StrategyArg) -> Union[Strategy, None]:
    """A fixed strategy, or None for "auto" (resolved at the first forward, once the backend wrapped it)."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        return strategy()
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be 'auto', a registered name or a Strategy instance, got {strategy!r}")
    if strategy == "auto":
        return None
    return get_strategy(strategy)
