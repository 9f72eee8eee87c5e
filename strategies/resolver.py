"""Picks the strategy for a module (the highest-priority registration whose class claims it), and asks the
strategies in play how a loss split across sequence-parallel ranks must scale.

"auto" resolves at every call: a class that declares ``claims_from_layout`` is asked once per layout of the
module (``_layout``; ``fully_shard``, FSDP1, ZeRO and ``parallelize_module`` all change it), every other class
(DDP, seen only while its forward runs) at every call."""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from torch import nn

from .base import SequenceParallelAware, Strategy, UnsupportedBackendError, process_group_ready
from .registry import Registration, get_strategy, registrations_by_priority

StrategyArg = Union[str, Strategy]

SEQUENCE_PARALLEL_UNAWARE_ERROR = (
    "sequence parallelism: the strategy {strategy!r} ({cls}) {role}, but does not implement the "
    "SequenceParallelAware capability, so the tiled loss cannot tell whether its gradient reduction sums or "
    "averages over the sequence-parallel ranks (a wrong guess scales every gradient by the group's size). Derive "
    "{cls} from tiled_mlp.SequenceParallelAware and implement check_sequence_group(module, group) and "
    "sums_over_sequence_ranks(module, group), or train without sequence parallelism."
)


def _layout(module: nn.Module, ancestors: Sequence[nn.Module]) -> Tuple[List[Any], List[int]]:
    """The modules and classes (held weakly), and the values compared by equality: the parameters by ``id``, their
    class and how many attributes they carry. A parameter is not held at all: a weak reference to it makes
    ``torch.utils.swap_tensors`` refuse it (``Module.to`` swaps a DTensor's), and a strong one would keep a
    replaced parameter's memory until the next call. An id is reused only after its tensor is freed, and a new
    parameter at the same address, of the same class and attribute count, is one the strategies claim alike."""
    objects: List[Any] = [*ancestors]
    counts = [process_group_ready(), len(module._forward_pre_hooks), len(module._forward_hooks)]
    todo: List[Optional[nn.Module]] = [module]
    while todo:
        sub = todo.pop()
        if sub is None:
            continue
        objects.append(type(sub))
        for p in sub._parameters.values():
            if p is not None:
                objects.append(type(p))
                counts += (id(p), len(p.__dict__))
        todo.extend(sub._modules.values())
    return objects, counts


@dataclass
class _Resolution:
    """What "auto" found for one layout: the registrations to ask at each call, each with whether it is known
    to claim. Held weakly: a module of the layout may hold the model."""

    registrations: List[Registration]
    refs: List[Any]
    counts: List[int]
    steps: List[Tuple[Registration, bool]]

    def holds(self, registrations: List[Registration], objects: List[Any], counts: List[int]) -> bool:
        return (registrations is self.registrations and counts == self.counts and len(objects) == len(self.refs)
                and all(map(operator.is_, (ref() for ref in self.refs), objects)))


_RESOLUTIONS: weakref.WeakKeyDictionary[nn.Module, _Resolution] = weakref.WeakKeyDictionary()


def resolve_strategy(module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> Strategy:
    registrations = registrations_by_priority()
    objects, counts = _layout(module, ancestors)
    found = _RESOLUTIONS.get(module)
    if found is None or not found.holds(registrations, objects, counts):
        steps = []
        for entry in registrations:
            claimed = entry.cls.claims_from_layout and entry.cls.claims(module, ancestors)
            if claimed or not entry.cls.claims_from_layout:
                steps.append((entry, claimed))
            if claimed:
                break
        found = _RESOLUTIONS[module] = _Resolution(registrations, [weakref.ref(o) for o in objects], counts, steps)
    for entry, claimed in found.steps:
        if claimed or entry.cls.claims(module, ancestors):
            return entry.build_for(module, ancestors)
    raise RuntimeError("no registered strategy claims the module (the single_device fallback was unregistered?)")


def sums_over_sequence_ranks(module: nn.Module, group: Any = None, strategy: Optional[Strategy] = None) -> bool:
    """Does a backend in play sum ``module``'s model's gradients over a sequence-parallel group's ranks? In play:
    ``strategy`` (the caller's fixed one), and the first registration of every ``SequenceParallelAware`` class
    (each answers from its backend's own state). With a ``group``, each first checks that it can carry a loss
    split across it. Refused: a fixed strategy without the capability, or a registered one without it that claims
    ``module``."""
    in_play: List[Any] = []
    if strategy is not None:
        if not isinstance(strategy, SequenceParallelAware):
            raise _unaware(strategy.name or type(strategy).__name__, type(strategy), "was given as the strategy")
        in_play.append(strategy)
    asked = set()
    for entry in registrations_by_priority():
        if entry.cls in asked:
            continue  # another registration of the same class runs only where a caller names it
        asked.add(entry.cls)
        if issubclass(entry.cls, SequenceParallelAware):
            in_play.append(entry.build())
        elif entry.cls.claims(module):
            raise _unaware(entry.name, entry.cls, f"claims {type(module).__name__}")
    return any([s.sums_over_sequence_ranks(module, group) for s in in_play])


def _unaware(name: str, cls: type, role: str) -> UnsupportedBackendError:
    return UnsupportedBackendError(SEQUENCE_PARALLEL_UNAWARE_ERROR.format(strategy=name, cls=cls.__name__, role=role))


def strategy_from_arg(strategy: StrategyArg) -> Union[Strategy, None]:
    """A fixed strategy (an instance as given, a registered name built with its stored arguments, a class built
    without arguments), or None for "auto"."""
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
