"""Time (CPU, or an accelerator's) of one loss forward+backward per method: one warm-up round, then rounds in which every
method runs once, each round starting at the next method, median over rounds.

Interleaving puts a slow spell of a shared machine (tens of percent over minutes) on every method alike,
and rotating the order keeps any method from always following the same neighbour (whose freed memory
or warm caches it would inherit). Freed memory stays in the process (``cpu_allocator``), as a GPU's
caching allocator keeps it, so the times measure compute, not page faults on fresh logits buffers.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from .cpu_allocator import keep_freed_memory_in_process
from .loss_methods import Step, run_step
from .measure import _synchronize  # an accelerator's step is timed to its end, not to its launch


def round_orders(names: List[str], rounds: int) -> List[List[str]]:
    """Round r runs the methods starting at the (r mod n)-th."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def timed_rounds(steps: Mapping[str, Step], head: nn.Linear, x: torch.Tensor, labels: torch.Tensor, rounds: int,
                 on_round: Optional[Callable[[str], None]] = None) -> Dict[str, List[float]]:
    """Seconds of every timed step, per method (``rounds`` each, the warm-up round not among them)."""
    device = x.device
    if device.type == "cpu":
        keep_freed_memory_in_process()
    names = list(steps)
    for name in names:
        run_step(steps[name], head, x, labels)
    if on_round is not None:
        on_round("warm-up round")
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    for index, order in enumerate(round_orders(names, rounds)):
        for name in order:
            _synchronize(device)
            start = time.perf_counter()
            run_step(steps[name], head, x, labels)
            _synchronize(device)
            seconds[name].append(time.perf_counter() - start)
        if on_round is not None:
            on_round(f"timed round {index + 1}/{rounds}")
    return seconds


def medians(seconds: Mapping[str, List[float]]) -> Dict[str, float]:
    return {name: statistics.median(values) for name, values in seconds.items()}
