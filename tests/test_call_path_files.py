"""One front door, a short path: the library files whose Python runs during a warm fast-path call.

A warm call of a tiled gated MLP (the fast kernel, a single device, the default settings), forward and
backward, is recorded with ``sys.setprofile``: every Python frame that runs, by its file. The library's files
(``tiled_core/``, ``strategies/``, ``tiled_mlp/``) among them are listed: at most 8 in all, at most 4 of them
above the sharded autograd Function (the call path: the tiled forward, the call, the strategy) and 3 below it.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Set

import pytest
import torch
from reference import GatedMLP, seeded

from tiled_mlp import TiledMLP
from tiled_mlp.core import auto_shards, strict

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = tuple(str(ROOT / name) + os.sep for name in ("tiled_core", "strategies", "tiled_mlp"))
# The layer below the call path: the sharded Function, its loops, kernels and gradient handling.
BELOW = ("tiled_core/sharded_autograd.py", "tiled_core/kernel_registry.py", "tiled_core/kernels/", "tiled_core/ops/")


def _library_files_run(step) -> Set[str]:
    seen: Set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    threading.setprofile(None)  # this thread only: the call and its backward run here on CPU
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    files = {os.path.realpath(name) for name in seen}
    return {os.path.relpath(name, ROOT) for name in files if name.startswith(LIBRARY)}


@pytest.fixture
def small_floor(monkeypatch):
    # The auto policy's floor lowered, so that a small call tiles (the policy itself is unchanged); the default
    # mode, also in the suite's strict pass (strict mode reads more at each call, by design).
    monkeypatch.setattr(auto_shards, "MIN_SAVED_BYTES", 2**20)
    monkeypatch.setattr(strict, "ON", False)


def _warm_fast_call():
    mlp = seeded(GatedMLP, 3, 32, 512, "silu", dtype=torch.float32)
    tiled = TiledMLP(mlp)  # the defaults: strategy="auto", num_shards="auto", path="auto"
    x = torch.randn(1, 2048, 32, requires_grad=True)
    dy = torch.randn(1, 2048, 32)

    def step():
        tiled(x).backward(dy)

    step()
    assert tiled.tiling.last_path == "fast" and tiled.tiling.last_num_shards > 1, tiled.tiling.last_reason
    return step


def test_the_call_path_of_a_warm_fast_call_touches_at_most_4_files(small_floor):
    files = _library_files_run(_warm_fast_call())
    above = sorted(name for name in files if not name.startswith(BELOW))
    assert len(above) <= 4, f"{len(above)} call-path files run in a warm fast-path call: {above}"


def test_the_layer_below_a_warm_fast_call_runs_at_most_3_files(small_floor):
    files = _library_files_run(_warm_fast_call())
    below = sorted(name for name in files if name.startswith(BELOW))
    assert "tiled_core/sharded_autograd.py" in below, below  # measured where it runs
    assert len(below) <= 3, f"{len(below)} files below the call path run in a warm fast-path call: {below}"


def test_a_warm_fast_call_touches_at_most_8_library_files(small_floor):
    files = sorted(_library_files_run(_warm_fast_call()))
    assert len(files) <= 8, f"{len(files)} library files run in a warm fast-path call: {files}"
