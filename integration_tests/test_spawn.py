"""The harness's own promise (``spawn.py``): a rank forked from the preloaded server starts as a spawned
one would, with the test process's environment at the run and generators of its own."""
from __future__ import annotations

import os
import random

import numpy
import torch

from .spawn import run_distributed


def _state(rank: int, world_size: int) -> tuple:
    return (os.environ.get("TILED_MLP_SPAWN_PROBE"), torch.rand(1).item(), numpy.random.rand(), random.random())


def test_a_rank_sees_the_environment_at_the_run_and_draws_its_own_random_numbers(tmp_path):
    first = run_distributed(_state, 2, tmp_path)  # the server starts here, without the variable
    os.environ["TILED_MLP_SPAWN_PROBE"] = "set after the server started"
    try:
        second = run_distributed(_state, 2, tmp_path)
    finally:
        del os.environ["TILED_MLP_SPAWN_PROBE"]
    assert [r[0] for r in first] == [None, None]
    assert [r[0] for r in second] == ["set after the server started"] * 2
    draws = [r[1:] for r in first + second]
    for generator in range(3):  # torch, NumPy, Python: no two ranks of any run draw the same number
        assert len({d[generator] for d in draws}) == len(draws), (generator, draws)
