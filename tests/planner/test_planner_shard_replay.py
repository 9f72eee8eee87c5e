"""A meta step whose same-size shards are modelled once and logged again (``tiled_mlp/planner/shard_replay.py``)
logs every allocation and free of the step that runs every shard, in the same order, with the same
bytes, kinds and labels: the tiled MLP (fast path), the tiled loss, the tiled norms (generic path, its
generator states), with and without checkpointing and checkpoint offload, the shorter shards last."""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("transformers")


from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.core.shard_plan import split_evenly  # noqa: E402
from tiled_mlp.planner import step as step_module  # noqa: E402
from tiled_mlp.planner.shard_replay import shards_replayed  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model, step_timeline  # noqa: E402

SEQ = 100
MLP_SHARDS, LOSS_SHARDS = 7, 9
# split_evenly puts the longer shards first: the last shards are shorter than the first (another key).
assert split_evenly(SEQ, MLP_SHARDS) == (15, 15, 14, 14, 14, 14, 14)
assert split_evenly(SEQ, LOSS_SHARDS) == (12,) + (11,) * 8

SETTINGS = [
    Setting(tiled=True, checkpointing=False, num_shards=MLP_SHARDS),
    Setting(tiled=False, checkpointing=False, tiled_loss=True, loss_num_shards=LOSS_SHARDS),
    Setting(tiled=True, checkpointing=True, num_shards=MLP_SHARDS, tiled_loss=True, loss_num_shards=LOSS_SHARDS),
    Setting(tiled=False, checkpointing=False, num_shards=MLP_SHARDS, tiled_norms=True),
    Setting(tiled=True, checkpointing=True, num_shards=MLP_SHARDS, tiled_loss=True, loss_num_shards=LOSS_SHARDS,
            offload_checkpoints=True, tiled_norms=True),
]


def replays_kept():
    """(the list, a stand-in for ``step.shards_replayed`` that keeps each step's replay in it)."""
    replays = []

    @contextlib.contextmanager
    def counted(tracker):
        with shards_replayed(tracker) as replay:
            replays.append(replay)
            yield replay

    return replays, counted


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_replayed_shards_log_the_full_step_event_for_event(setting, monkeypatch):
    replays, counted = replays_kept()
    model = build_model(small_planner_llama(2), None, torch.bfloat16, "meta", setting)
    full = step_timeline(model, SEQ, 1, describe=True, replay_shards=False)
    monkeypatch.setattr(step_module, "shards_replayed", counted)
    short = step_timeline(model, SEQ, 1, describe=True)
    assert len(replays) == 1
    assert replays[0].replayed > 0, "no kernel call was replayed: the shortcut is not in use"
    assert short.events == full.events
    assert short.points == full.points and short.host == full.host and short.host_at_peak == full.host_at_peak


def test_a_cpu_step_runs_every_shard(monkeypatch):
    setting = Setting(tiled=True, checkpointing=False, num_shards=MLP_SHARDS, tiled_loss=True,
                      loss_num_shards=LOSS_SHARDS)
    seen = []

    def counted(tracker):
        seen.append(tracker)
        return shards_replayed(tracker)

    monkeypatch.setattr(step_module, "shards_replayed", counted)
    step_timeline(build_model(small_planner_llama(2), None, torch.float32, "cpu", setting), SEQ, 1)
    assert seen == [], "a measured CPU step must not be shortened"


@pytest.mark.parametrize("setting", SETTINGS[2:], ids=lambda s: s.name)
def test_the_full_depth_check_replays_shards_and_logs_every_shard(setting, monkeypatch):
    """The check of an answer (``Planner._full_depth_record``) steps every layer of the full-depth model
    with its shards replayed: its record is the one of the full-depth step that runs every shard."""
    from tiled_mlp.planner.backends import Backend
    from tiled_mlp.planner.plan import Planner, Request

    replays, counted = replays_kept()
    planner = Planner(Request(small_planner_llama(5), [SEQ], [setting], Backend("single", 1), dtype=torch.bfloat16))
    assert planner.composable(setting), "the model's step is composed: its answers are checked at full depth"
    every_shard = planner.timeline(setting, SEQ, describe=True, full_depth=True)
    expected = planner.point_of(setting, SEQ, every_shard, planner.request.backend).record()
    monkeypatch.setattr(step_module, "shards_replayed", counted)
    checked = planner._full_depth_record(setting, SEQ)
    assert len(replays) == 1 and replays[0].replayed > 0, "the check's step replays shards"
    assert checked == expected
    replayed = planner.timeline(setting, SEQ, describe=True, full_depth=True, replay_shards=True)
    assert replayed.events == every_shard.events and replayed.points == every_shard.points
    assert replayed.host == every_shard.host and replayed.host_at_peak == every_shard.host_at_peak
