"""A plan's settings modelled side by side: each group of settings that share no step (a tiled setting
and its untiled twin go together, ``pass_through.twin_groups``) by a forked copy of the planner
(``workers.py``), then made the planner's own, so that it holds what it would have modelled alone, in
the same order. On two cores an 8B plan's settings take about half as long (``docs/planner.md``)."""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

from .pass_through import twin_groups
from .plan import Planned, Planner
from .search import Longest
from .step import Setting
from .workers import run_tasks


def plan_settings(planner: Planner, processes: int, on_label: Callable[[str], None],
                  search_labels: int) -> Dict[Setting, Longest]:
    """Every setting's table points (``request.seqs``) and longest length, modelled by up to ``processes``
    processes; the planner then holds every point (``Planner.modelled``) as if it had modelled them in turn.
    ``on_label`` gets one label a table point and ``search_labels`` a search, whatever the search takes."""
    groups = sorted(twin_groups(planner.request.settings), key=_parts_modelled, reverse=True)
    tasks = [functools.partial(_plan_group, planner, group, search_labels) for group in groups]
    parts = {s: part for done in run_tasks(tasks, on_label, processes) for s, part in done.items()}
    planner.adopt({s: parts[s] for s in planner.request.settings})
    return {s: parts[s].longest for s in planner.request.settings}


def _parts_modelled(group: List[Setting]) -> int:
    """How much each step of ``group`` models, roughly (each tiled piece, checkpointing and offload add
    ops to every step): the costliest groups go to the workers first, so that they end together. The
    order changes when each group is done, never the plan."""
    return sum(s.tiled + s.tiled_loss + s.tiled_norms + s.checkpointing + s.offload_checkpoints for s in group)


def _plan_group(planner: Planner, group: List[Setting], search_labels: int,
                on_label: Callable[[str], None]) -> Dict[Setting, Planned]:
    planner.on_point = on_label
    for seq in planner.request.seqs:
        for setting in group:
            planner.point(setting, seq)
    parts: Dict[Setting, Planned] = {}
    for setting in group:
        used = [0]

        def counted(label: str, used=used) -> None:
            used[0] += 1
            if used[0] <= search_labels:
                on_label(label)

        planner.on_point = counted
        parts[setting] = planner.planned(setting, planner.longest(setting))
        for _ in range(search_labels - min(used[0], search_labels)):
            on_label(f"{setting.name}: longest found")
    planner.on_point = lambda label: None
    return parts
