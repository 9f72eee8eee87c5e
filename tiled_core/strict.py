"""Strict mode: the per-call checks that guard against rare configurations, off by default
(``TILED_MLP_STRICT=1``, read at import, or ``set_strict``). Which checks, and what each guards against:
docs/architecture.md, "Strict mode".
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
    if ON != previous:
        # A plan made in the other mode checks other things at each call. (Imported here: the registry's
        # module imports this one.)
        from .kernel_registry import GENERATION
        GENERATION[0] += 1
    return previous


@contextlib.contextmanager
def strict_mode(on: bool = True) -> Iterator[None]:
    """Strict mode inside the block (tests: ``with strict_mode(): ...``)."""
    previous = set_strict(on)
    try:
        yield
    finally:
        set_strict(previous)
