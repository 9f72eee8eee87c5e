"""``--json``: stdout carries one JSON document and nothing else.

Other libraries write to stdout while a command runs: DeepSpeed logs "Setting accelerator to CPU" through a
handler made on ``sys.stdout`` when its logging module is first imported, which happens during the plan (its
sequence-parallel attention). Within ``only_json`` both ``sys.stdout`` and the process's stdout (file
descriptor 1, so that C code and handlers made on it are caught too) point at stderr, and ``emit`` writes
the document to the stdout there was before.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Iterator, Optional, TextIO

_document: Optional[TextIO] = None  # the real stdout while ``only_json`` holds fd 1


@contextlib.contextmanager
def only_json(enabled: bool = True) -> Iterator[None]:
    global _document
    if not enabled:
        yield
        return
    original = sys.stdout
    original.flush()
    try:
        on_fd = original.fileno() == 1
    except (AttributeError, OSError, ValueError):  # a stand-in without a descriptor (pytest's capture)
        on_fd = False
    saved = os.dup(1) if on_fd else -1
    if on_fd:
        os.dup2(2, 1)
    _document = os.fdopen(saved, "w") if on_fd else original
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = original
        if on_fd:
            os.dup2(saved, 1)
            _document.close()
        _document = None


def emit(value: Any) -> None:
    """``value`` as indented JSON on the real stdout (on ``sys.stdout`` outside ``only_json``)."""
    out = _document or sys.stdout
    out.write(json.dumps(value, indent=2) + "\n")
    out.flush()
