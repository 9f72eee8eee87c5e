"""Picks the strategy for a module (the highest-priority registration whose class claims it, built as
configured), and asks the strategies in play how a loss split across sequence-parallel ranks must scale.

"auto" resolves at every call of a module, so the resolver decides once what it can: a class that declares
``claims_from_layout`` is asked once per *layout* of the module, remembered per module and compared by
identity at each call (the registry's order, which also says whether a process group is initialised; the
recorded ancestors; the classes of the module tree; each parameter object and how many attributes it
carries; the module's own hook counts). Wrapping changes the layout: ``fully_shard`` and FSDP1 replace
the parameters, ZeRO marks them with attributes, ``parallelize_module`` makes them DTensors and adds hooks.
Every other class (DDP, seen only while its forward runs; a third party's) is asked at every call, in order.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from torch import nn

from .base import SequenceParallelAware, Strategy, UnsupportedBackendError
from .registry import Registration, claimable_registrations, get_strategy, registrations_by_priority

StrategyArg = Union[str, Strategy]

SEQUENCE_PARALLEL_UNAWARE_ERROR = (
    "sequence parallelism: the strategy {strategy!r} ({cls}) {role}, but does not implement the "
    "SequenceParallelAware capability, so the tiled loss cannot tell whether its gradient reduction sums or "
    "averages over the sequence-parallel ranks (a wrong guess scales every gradient by the group's size). Derive "
    "{cls} from tiled_mlp.SequenceParallelAware and implement check_sequence_group(module, group) and "
    "sums_over_sequence_ranks(module, group), or train without sequence parallelism."
)


def _layout(module: nn.Module, ancestors: Sequence[nn.Module]) -> Tuple[List[Any], List[int]]:
    """What a ``claims_from_layout`` class may read: the objects (ancestors, each submodule's class, each
    parameter), and counts (the module's hooks, each parameter's attributes)."""
    objects: List[Any] = [*ancestors]
    counts = [len(module._forward_pre_hooks), len(module._forward_hooks)]
    todo: List[Optional[nn.Module]] = [module]
    while todo:
        sub = todo.pop()
        if sub is None:
            continue
        objects.append(type(sub))
        for p in sub._parameters.values():
            if p is not None:
                objects.append(p)
                counts.append(len(p.__dict__))
        todo.extend(sub._modules.values())
    return objects, counts


@dataclass
class _Resolution:
    """What "auto" found for one layout: the registrations to go through at each call, in order, each with
    whether it is known to claim (the last one, where a layout class claimed). The layout's objects are held
    weakly: a parameter keeps its optimizer, which may keep the model."""

    registrations: List[Registration]
    refs: List[Any]
    counts: List[int]
    steps: List[Tuple[Registration, bool]]

    def holds(self, registrations: List[Registration], objects: List[Any], counts: List[int]) -> bool:
        return (registrations is self.registrations and counts == self.counts and len(objects) == len(self.refs)
                and all(map(operator.is_, (ref() for ref in self.refs), objects)))


_RESOLUTIONS: weakref.WeakKeyDictionary[nn.Module, _Resolution] = weakref.WeakKeyDictionary()


def resolve_strategy(module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> Strategy:
    registrations = claimable_registrations()
    if registrations.reads_layout:
        objects, counts = _layout(module, ancestors)
        found = _RESOLUTIONS.get(module)
        if found is None or not found.holds(registrations, objects, counts):
            found = _RESOLUTIONS[module] = _Resolution(registrations, [weakref.ref(o) for o in objects], counts,
                                                       _steps(registrations, module, ancestors))
        for entry, claimed in found.steps:
            if claimed or entry.cls.claims(module, ancestors):
                return entry.build_for(module, ancestors)
    else:
        for entry in registrations:
            if entry.cls.claims(module, ancestors):
                return entry.build_for(module, ancestors)
    raise RuntimeError("no registered strategy claims the module (the single_device fallback was unregistered?)")


def _steps(registrations: List[Registration], module: nn.Module, ancestors: Sequence[nn.Module]) -> List[Tuple[Registration, bool]]:
    steps = []
    for entry in registrations:
        if not entry.cls.claims_from_layout:
            steps.append((entry, False))
        elif entry.cls.claims(module, ancestors):
            steps.append((entry, True))
            break
    return steps


def sums_over_sequence_ranks(module: nn.Module, group: Any = None, strategy: Optional[Strategy] = None) -> bool:
    """Does a backend in play sum ``module``'s model's gradients over a sequence-parallel group's ranks
    (``SequenceParallelAware.sums_over_sequence_ranks``)? In play: every registered strategy with that
    capability (each answers from its backend's own state: a frozen ``lm_head`` is claimed by none), and
    ``strategy``, the one the caller fixed. With a ``group``, each one first checks that it can carry a
    loss split across it, whatever the others answer. Refused before any of them is asked: a fixed
    strategy without the capability, or a registered one without it that claims ``module``."""
    in_play = _sequence_parallel_strategies(module, strategy)
    return any([s.sums_over_sequence_ranks(module, group) for s in in_play])


def _sequence_parallel_strategies(module: nn.Module, fixed: Optional[Strategy]) -> List[SequenceParallelAware]:
    found: List[SequenceParallelAware] = []
    if fixed is not None:
        if not isinstance(fixed, SequenceParallelAware):
            raise _unaware(fixed, type(fixed), "was given as the strategy")
        found.append(fixed)
    # Per class, the registration "auto" would resolve (the first by priority); another registration
    # of the same class, under its own name and arguments, runs only where a caller names it. An aware class
    # answers from its backend's own state, claimed or not; an unaware one is asked to claim only where "auto"
    # would ask it.
    asked = set()
    claimable = claimable_registrations()
    for entry in registrations_by_priority():
        if entry.cls in asked:
            continue
        asked.add(entry.cls)
        if issubclass(entry.cls, SequenceParallelAware):
            found.append(entry.build())  # type: ignore[arg-type]  # an aware class builds an aware instance
        elif entry in claimable and entry.cls.claims(module):
            raise _unaware(entry.name, entry.cls, f"claims {type(module).__name__}")
    return found


def _unaware(strategy: Any, cls: type, role: str) -> UnsupportedBackendError:
    name = strategy if isinstance(strategy, str) else getattr(strategy, "name", "") or cls.__name__
    return UnsupportedBackendError(SEQUENCE_PARALLEL_UNAWARE_ERROR.format(strategy=name, cls=cls.__name__, role=role))


def strategy_from_arg(strategy: StrategyArg) -> Union[Strategy, None]:
    """A fixed strategy (an instance used as given, a registered name built with its stored arguments, a
    class built without arguments), or None for "auto" (resolved at the first forward, once the backend
    wrapped it)."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        try:
            return strategy()
        except TypeError as error:
            raise TypeError(f"strategy={strategy.__name__} cannot be built without arguments ({error}); pass an "
                            f"instance, strategy={strategy.__name__}(...), or register it with its arguments and "
                            "pass its name") from None
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be 'auto', a registered name or a Strategy instance, got {strategy!r}")
    if strategy == "auto":
        return None
    return get_strategy(strategy)
