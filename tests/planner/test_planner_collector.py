"""A plan modelled with the cyclic garbage collector paused (``tiled_mlp/planner/collector.py``, as the CLI
runs it) is the plan modelled with the collector running after nearly every allocation: every point of
the table and the search, the longest lengths, each event of a described step."""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("transformers")


from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.collector import collector_paused  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402

SETTINGS = [
    Setting(tiled=False, checkpointing=False),
    Setting(tiled=True, checkpointing=True, num_shards=3, tiled_loss=True, loss_num_shards=4,
            offload_checkpoints=True),
]


def plan() -> tuple:
    planner = Planner(Request(small_planner_llama(4), [256, 1024], SETTINGS, Backend("single", 1), dtype=torch.bfloat16,
                              budget=12 * 2**20, seq_step=128, seq_cap=4096))
    for seq in planner.request.seqs:
        for setting in SETTINGS:
            planner.point(setting, seq)
    longest = [planner.longest(s) for s in SETTINGS]
    assert all(0 < found.seq < 4096 for found in longest), "each search ends inside the grid"
    described = [planner.timeline(s, 512, describe=True).events for s in SETTINGS]
    assert all(planner.composable(s) for s in SETTINGS)
    return [p.record() for p in planner.modelled()], longest, described


def test_a_plan_with_the_collector_paused_is_the_plan_with_it_running_all_along():
    with collector_paused():
        assert not gc.isenabled()
        paused = plan()
    assert gc.isenabled(), "the collector is running again after the block"
    thresholds = gc.get_threshold()
    gc.freeze()  # what was alive before (torch, transformers) is not walked at every allocation
    gc.set_threshold(1)
    try:
        running = plan()
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    assert paused[1] == running[1]
    assert paused[0] == running[0]
    assert paused[2] == running[2]
