"""The cyclic garbage collector paused while a plan is modelled.

A plan is a few hundred thousand Python objects kept alive (the steps' logs, a million events for a
composed step) and millions made and dropped; the collector's passes over them cost the CLI 0.6 to
0.75 s of an 8B plan, and free nothing a step's log records: every storage the tracker
follows is freed by its reference count, at the moment the code drops it (``tests/planner/test_planner_collector.py``
holds a plan made with the collector paused equal to one made with it running after nearly every
allocation). Paused, the collector also cannot move a free inside a step, so a step's log never depends
on when it last ran.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection within the block; the collector as it was after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
