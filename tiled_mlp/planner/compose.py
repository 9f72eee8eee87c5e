"""A full-depth step's log put together from two shallow steps, for models whose decoder layers are alike.

A step's log (``timeline.py``: each storage allocated or freed, with its kind and bytes) has three
sections: the weights' tracking, the forward with the loss, the backward. With ``n`` alike layers each
section is ``before + layer * n + after``: every layer tracks the same parameters, runs the same ops on
the same shapes, keeps the same tensors and frees them in the same order. Modelled at two depths
``d`` and ``d + 1``, each section of the deeper log is the shallower one with one layer's events
inserted; the insertion is found (where the two logs first differ), checked (everything after it must
be the shallower log's), and repeated to make any depth. The memory at every moment is then the
replay of that log, the same replay a full-depth step gets, so the composed timeline is the full-depth
one event for event, not an extrapolation of peaks (which the moments' changing ranking makes wrong).

The CPU generator states the generic tiled path saves (``rng_states.py``) are freed together when the
step drops its graph, after the last layer's backward: each layer adds its own to that run of frees as
well as its events in the body of the backward. A section is therefore three logs, its body, that run,
and what follows it (the loss, freed with the graph), each composed by one insertion.

``d`` is 2: a layer that differs by its place (checkpoint offload keeps the last layer's input on
the device) stays the last, and the inserted layer is an inner one. Models whose layers differ (MoE
and dense, sliding and full attention by ``layer_types``) are not composed (``layers_alike``); that
the composed log equals the full-depth step's is checked against real CPU steps at several depths and
lengths (``tests/planner/test_planner_compose.py``), and the planner models its reported lengths at full depth.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from torch import nn

from .layers import describe_kinds
from .timeline import GENERATOR_STATES, Event, Runs

SHALLOW = 2  # the depths modelled are SHALLOW and SHALLOW + 1


def layers_alike(config, layers: nn.ModuleList) -> bool:
    """Every decoder layer of the same classes, parameter names and shapes, and of one ``layer_types``
    entry where the config has them (Gemma's sliding and full attention share their classes)."""
    layer_types = getattr(config.get_text_config(), "layer_types", None)
    if isinstance(layer_types, list) and len(set(layer_types)) > 1:
        return False
    if describe_kinds(layers):
        return False
    shapes = [[(name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters()] for layer in layers]
    return all(s == shapes[0] for s in shapes)


def compose(shallow: Sequence[List[Event]], deeper: Sequence[List[Event]], layers: int) -> Optional[Runs]:
    """The log of a step with ``layers`` layers from the sections of the steps with ``SHALLOW`` and
    ``SHALLOW + 1``, as runs, the inserted layer's repeated (None: a section of the deeper step is not the
    shallower one with one insertion)."""
    if len(shallow) != len(deeper) or layers < SHALLOW:
        return None
    out: Runs = []
    for short, long in zip(shallow, deeper, strict=True):
        for short_part, long_part in zip(_closing_states(short), _closing_states(long), strict=True):
            at = _insertion(short_part, long_part)
            if at is None:
                return None
            inserted = long_part[at:at + len(long_part) - len(short_part)]
            out += [(short_part[:at], 1), (inserted, layers - SHALLOW), (short_part[at:], 1)]
    return out


def _closing_states(section: List[Event]) -> Tuple[List[Event], List[Event], List[Event]]:
    """``section`` as its body, its last run of generator-state frees (empty where it has none) and what
    follows that run (the loss, freed with the graph)."""
    def freed_state(event: Event) -> bool:
        return event[0] == GENERATOR_STATES and not event[2]

    end = next((i + 1 for i in range(len(section) - 1, -1, -1) if freed_state(section[i])), len(section))
    start = end
    while start and freed_state(section[start - 1]):
        start -= 1
    return section[:start], section[start:end], section[end:]


def _insertion(short: List[Event], long: List[Event]) -> Optional[int]:
    """Where ``long`` is ``short`` with events inserted: the first place the two differ (any later place
    that also works makes the same repeated log); None when the rest of ``long`` is not ``short``'s."""
    extra = len(long) - len(short)
    if extra < 0:
        return None
    at = 0
    while at < len(short) and short[at] == long[at]:
        at += 1
    return at if long[at + extra:] == short[at:] else None
