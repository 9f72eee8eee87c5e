"""A tiled-MLP setting shares its untiled twin's step exactly where the auto policy passes every MLP
through (``tiled_mlp/planner/pass_through.py``): there the shared step is the tiled setting's own,
after every allocation, and one length further, where the policy tiles, the two steps differ."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.presets import load_config  # noqa: E402
from tiled_mlp.planner.step import Setting, step_timeline  # noqa: E402

# Llama-3.1-8B's sizes on four layers (the step is composed from shallow ones, as the plan's is):
# the auto policy passes its MLPs through up to 2048 tokens and tiles them at 3072 (3 shards).
PASSED_THROUGH, TILED = (1024, 2048), 3072
SETTINGS = [Setting(tiled=True, checkpointing=False),
            Setting(tiled=True, checkpointing=True),
            Setting(tiled=True, checkpointing=False, tiled_loss=True),
            Setting(tiled=True, checkpointing=True, tiled_loss=True, offload_checkpoints=True)]


def _llama8b_planner(setting: Setting, dtype: torch.dtype = torch.bfloat16) -> Planner:
    config = load_config("llama-3.1-8b")
    config.num_hidden_layers = 4
    return Planner(Request(config, [], [setting], Backend("single", 1), dtype=dtype, budget=80 * 2**30))


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_a_tiled_setting_shares_its_twins_step_only_where_every_mlp_passes_through(setting):
    planner = _llama8b_planner(setting)
    own = planner.model(setting)  # the tiled setting's full-depth model, modelled without any sharing
    for seq in (*PASSED_THROUGH, TILED):
        twin = planner.pass_through_twin(setting, seq)
        assert (twin is not None) == (seq in PASSED_THROUGH), (setting.name, seq)
        shared = planner.timeline(setting, seq, full_depth=True)
        real = step_timeline(own, seq, 1, replay_shards=False)
        assert (shared.points, shared.host, shared.host_at_peak) == (real.points, real.host, real.host_at_peak), seq
        composed = planner.point(setting, seq)
        assert composed.record() == planner.point_of(setting, seq, real, planner.request.backend).record()
    untiled = planner.timeline(Setting(**{**setting.__dict__, "tiled": False}), TILED)
    assert untiled.points != planner.timeline(setting, TILED).points, "where auto tiles, the twin's step differs"


def test_the_rule_is_the_policys_for_the_dtype_and_leaves_fixed_counts_and_tiled_norms_alone():
    # float32 doubles every byte of the policy's sums alike, so the boundary is where bf16's is.
    planner = _llama8b_planner(Setting(tiled=True, checkpointing=False), torch.float32)
    assert planner.pass_through_twin(Setting(tiled=True, checkpointing=False), 2048) is not None
    assert planner.pass_through_twin(Setting(tiled=True, checkpointing=False), 3072) is None
    fixed = Setting(tiled=True, checkpointing=False, num_shards=2)
    norms = Setting(tiled=True, checkpointing=False, tiled_norms=True)
    assert planner.pass_through_twin(fixed, 1024) is None and planner.pass_through_twin(norms, 1024) is None
