"""The harness's own promise: ranks see the environment their server started with, so a run refuses to
start once a variable has changed (``spawn.py``)."""
from __future__ import annotations

import os

import pytest

from .spawn import run_distributed


def _variable(rank: int, world_size: int) -> str | None:
    return os.environ.get("TILED_MLP_SPAWN_PROBE")


def test_a_changed_environment_is_refused_and_an_unchanged_one_runs(tmp_path):
    assert run_distributed(_variable, 2, tmp_path) == [None, None]
    os.environ["TILED_MLP_SPAWN_PROBE"] = "set after the server started"
    try:
        with pytest.raises(RuntimeError, match="TILED_MLP_SPAWN_PROBE.*pass the values to the ranks as arguments"):
            run_distributed(_variable, 2, tmp_path)
    finally:
        del os.environ["TILED_MLP_SPAWN_PROBE"]
    assert run_distributed(_variable, 2, tmp_path) == [None, None]
