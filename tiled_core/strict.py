"""Strict mode: the per-call checks that guard against rare configurations, off by default.

By default a tiled call decides once (when a module is first called, and again where something a training
step can change has changed: a class or forward rebound, a hook added, the strategy, the input's dtype or
device, the training mode, autocast) and checks only that, by identity. Strict mode
(``TILED_MLP_STRICT=1`` in the environment, read at import, or ``set_strict(True)``) adds what no
mainstream configuration needs but a paranoid run may want:

- every attribute of every submodule by identity, and the plain values the generic path's recompute reads
  again (``plain_values``: the bytecode of the tree's methods is read to find them);
- the fast path's proof guards: the classes, module globals and torch functions its proof read
  (``gated_forms.ProofReads``);
- tensors kept by a hook after their shard (waiting on a collective's buffers, with ``gc.collect``).

(Buffers updated in place by the forward, ``buffer_guard``, are refused in both modes: a module without
buffers, most MLPs, enters no guard.)
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

#: Read by the call path at each call (a module attribute: ``strict.ON``).
ON: bool = os.environ.get("TILED_MLP_STRICT", "").strip() not in ("", "0")


def set_strict(on: bool) -> bool:
    """Turn strict mode on or off for the calls that follow; returns the previous setting."""
    global ON
    previous, ON = ON, bool(on)
    return previous


@contextlib.contextmanager
def strict_mode(on: bool = True) -> Iterator[None]:
    """Strict mode inside the block (tests: ``with strict_mode(): ...``)."""
    previous = set_strict(on)
    try:
        yield
    finally:
        set_strict(previous)
