"""A deep step put together from its 2- and 3-layer steps (``tiled_mlp/planner/compose.py``) is the real
full-depth step, after every allocation, at several depths and lengths; models whose layers differ are
modelled at full depth."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from planner_checks import predicted_to_the_byte  # noqa: E402

from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.compose import compose  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402
from tiled_mlp.planner.timeline import HOST_KINDS, Timeline, replay  # noqa: E402

SETTINGS = [Setting(tiled=False, checkpointing=False),
            Setting(tiled=True, checkpointing=True, num_shards=3, tiled_loss=True, offload_checkpoints=True),
            Setting(tiled=True, checkpointing=False, num_shards=2, tiled_norms=True)]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("layers,seq", [(4, 48), (7, 96)])
def test_a_composed_step_is_the_real_full_depth_step_to_the_byte(setting, layers, seq):
    planner, _, _ = predicted_to_the_byte(setting, small_planner_llama(layers), seq)
    assert len(planner.stepped(setting)) == 2, "the step was composed from the 2- and 3-layer steps"


def test_layers_that_differ_by_their_attention_are_modelled_at_full_depth():
    config = small_planner_llama(5)
    config.layer_types = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    setting = Setting(tiled=False, checkpointing=False)
    planner = Planner(Request(config, [32], [setting], Backend("single", 1), dtype=torch.float32))
    planner.timeline(setting, 32)
    assert [len(list(m.model.layers)) for m in planner.stepped(setting)] == [5]


def test_a_log_that_is_not_one_insertion_is_not_composed():
    a, b, c = ("activations", 8, True, ""), ("activations", 8, False, ""), ("gradients", 4, True, "")
    composed = compose([[a, b]], [[a, b, a, b]], 5)
    assert composed is not None and Timeline(composed, describe=True).events == [a, b] * 4  # two layers, then three more
    assert compose([[a, b]], [[c, a, b, a]], 5) is None


def test_an_answer_the_full_depth_step_contradicts_is_searched_again_at_full_depth(monkeypatch):
    from tiled_mlp.planner import plan as plan_module

    setting = Setting(tiled=False, checkpointing=True)

    def planner(budget=None):
        return Planner(Request(small_planner_llama(6), [], [setting], Backend("single", 1), dtype=torch.float32,
                               budget=budget, seq_step=64, seq_cap=4096))

    budget = planner().point(setting, 1024).held_bytes
    right = plan_module.compose
    monkeypatch.setattr(plan_module, "compose", lambda *args: None)  # every step at full depth
    truth = planner(budget).longest(setting)
    monkeypatch.setattr(plan_module, "compose", lambda shallow, deeper, layers: right(shallow, deeper, layers - 3))
    checked = planner(budget)
    assert checked.longest(setting) == truth and truth.seq == 1024
    assert setting in checked._full_depth_only, "the composed answer was wrong and was caught"


def test_runs_give_the_peaks_of_their_log_written_out():
    # The peaks of a composed log are found without writing out its repeats (``Timeline``): held equal
    # to the log written out, for repeats that raise the total, lower it, or leave it as it was.
    import random

    rng = random.Random(0)
    kinds = ["activations", "logits and loss", "gradients", "weights", *HOST_KINDS]
    for trial in range(300):
        runs = []
        for _ in range(rng.randint(1, 4)):
            live: list = []
            events = []
            for n in range(rng.randint(1, 12)):
                if live and rng.random() < 0.4:
                    kind, nbytes, label = live.pop(rng.randrange(len(live)))
                    events.append((kind, nbytes, False, label))
                else:
                    kind, nbytes = rng.choice(kinds), rng.choice([8, 16, 24, 64]) * (trial % 3 + 1)
                    live.append((kind, nbytes, f"op{n % 3}"))
                    events.append((kind, nbytes, True, f"op{n % 3}"))
            if rng.random() < 0.3:  # a repeat that frees all it made: each repeat the same
                events += [(kind, nbytes, False, label) for kind, nbytes, label in live]
            runs.append((events, rng.choice([1, 2, 5])))
        written = replay([e for events, count in runs for _ in range(count) for e in events], describe=True)
        composed = Timeline(runs, describe=True)
        for scales in [(1.0, 1.0), (0.125, 0.125), (1 / 6, 0.5), (2.0, 0.0), (0.0, 1.0)]:
            assert composed.peak(*scales) == written.peak(*scales), (trial, scales)
            assert composed.at_peak(*scales) == written.at_peak(*scales), (trial, scales)
        assert (composed.host_peak(), composed.host_at_peak) == (written.host_peak(), written.host_at_peak), trial
        assert (composed.points, composed.host) == (written.points, written.host), trial
