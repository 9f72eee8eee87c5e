"""The whole-model planner (``tiled-mlp plan --model``): its prediction against the measured peak of
the real step, its depth model, its bisection, its output, and its errors before any work."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402

from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.planner import plan as plan_module  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.presets import load_config  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model, step_timeline  # noqa: E402

pytestmark = pytest.mark.timeout(180)

SETTINGS = {
    "untiled": Setting(tiled=False, checkpointing=False),
    "tiled": Setting(tiled=True, checkpointing=False, num_shards=4),
    "untiled+ckpt": Setting(tiled=False, checkpointing=True),
    "tiled+ckpt": Setting(tiled=True, checkpointing=True, num_shards=4),
}


def tiny_llama(layers: int = 3) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=352, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_prediction_matches_the_measured_real_step_within_5_percent(name):
    """Predicted: the meta-device step at 1 and 2 layers, extrapolated to 3. Measured: the real 3-layer
    step on the CPU (fp32, random weights and tokens), with the same exact live-storage tracker."""
    setting, config, seq = SETTINGS[name], tiny_llama(3), 1024
    planner = Planner(Request(config, [seq], [setting], Backend("single", 1), dtype=torch.float32))
    predicted = planner.point(setting, seq).peak_bytes
    real = build_model(config, 3, torch.float32, "cpu", setting)
    measured, _ = step_timeline(real, seq, 1).peak()
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    if setting.tiled:
        assert all(m.tiling.last_num_shards == 4 for m in real.modules() if hasattr(m, "tiling"))


@pytest.mark.parametrize("name", ["untiled", "tiled+ckpt"])
def test_the_step_is_affine_in_depth(name):
    """What lets two shallow builds stand for the full depth: each extra layer adds the same bytes."""
    config = tiny_llama()
    peaks = [step_timeline(build_model(config, depth, torch.float32, "meta", SETTINGS[name]), 2048, 1).peak()[0]
             for depth in (1, 2, 3, 4, 6)]
    steps = [peaks[i + 1] - peaks[i] for i in range(3)]
    assert steps[0] > 0 and steps.count(steps[0]) == 3
    assert peaks[4] == peaks[0] + 5 * steps[0]


def test_bisection_is_monotone_and_agrees_with_the_table():
    config = tiny_llama(4)
    settings = list(SETTINGS.values())
    budget = 24 * 2**20
    planner = Planner(Request(config, [1024, 4096, 8192], settings, Backend("single", 1), dtype=torch.float32,
                              budget=budget, seq_step=256, seq_cap=2**15))
    longest = {}
    for setting in settings:
        best = planner.max_seq(setting)
        longest[setting.name] = best
        assert best > 0 and planner.fits(setting, best) and not planner.fits(setting, best + 256)
        for seq in (1024, 4096, 8192):
            assert planner.fits(setting, seq) == (seq <= best)
        fitted = sorted((p.seq, p.fits) for p in planner.modelled() if p.setting == setting.name)
        flags = [fits for _, fits in fitted]
        assert flags == sorted(flags, reverse=True), "fits must go from yes to no once as the length grows"
    # Tiling and checkpointing only ever lengthen what fits.
    assert longest["tiled"] >= longest["untiled"] and longest["untiled+ckpt"] >= longest["untiled"]


def test_sharding_divides_weights_gradients_and_optimizer_but_not_activations():
    config = load_config("llama-3.1-8b")
    setting = Setting(tiled=True, checkpointing=True)
    one = Planner(Request(config, [8192], [setting], Backend("single", 1))).point(setting, 8192)
    eight = Planner(Request(config, [8192], [setting], Backend("fsdp2", 8))).point(setting, 8192)
    assert eight.optimizer_bytes == pytest.approx(one.optimizer_bytes / 8)
    assert eight.parts["weights"] == pytest.approx(one.parts["weights"] / 8)
    assert eight.parts["activations"] == pytest.approx(one.parts["activations"])
    assert eight.parts["backend in flight"] > 0


def test_json_records_and_the_longest_sequence(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--seq", "4096,8192", "--world-size", "8", "--backend", "fsdp2",
                 "--budget", "80GiB", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    points = [r for r in records if "seq" in r]
    assert {r["setting"] for r in points} == {"untiled", "tiled", "untiled+ckpt", "tiled+ckpt"}
    assert len(points) == 8
    for r in points:
        assert {"seq", "setting", "peak_bytes", "optimizer_bytes", "fits"} <= set(r)
    longest = {r["setting"]: r["max_seq"] for r in records if "max_seq" in r}
    assert set(longest) == {"untiled", "tiled", "untiled+ckpt", "tiled+ckpt"}
    for r in points:
        assert r["fits"] == (r["seq"] <= longest[r["setting"]])


def test_the_table_names_the_logits_and_their_knob(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--seq", "65536", "--checkpointing", "layer", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "logits and loss" in out and "fused_linear_cross_entropy" in out and "analytic" in out


def _error(capsys, argv, monkeypatch) -> str:
    def no_work(*args, **kwargs):
        raise AssertionError("a step was modelled before the arguments were checked")

    monkeypatch.setattr(plan_module, "step_timeline", no_work)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_missing_config_path_is_named(capsys, monkeypatch, tmp_path):
    err = _error(capsys, ["plan", "--model", str(tmp_path / "nope" / "config.json")], monkeypatch)
    assert "no such file or directory" in err


def test_an_unreadable_config_is_named(capsys, monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    err = _error(capsys, ["plan", "--model", str(tmp_path)], monkeypatch)
    assert "cannot read a transformers config" in err


def test_an_unknown_preset_lists_the_presets(capsys, monkeypatch):
    err = _error(capsys, ["plan", "--model", "llama-9000"], monkeypatch)
    assert "not a known preset" in err and "llama-3.1-8b" in err


def test_a_budget_below_the_weights_is_refused(capsys, monkeypatch):
    err = _error(capsys, ["plan", "--model", "llama-3.1-8b", "--budget", "10GiB"], monkeypatch)
    assert "smaller than the weights alone" in err and "14.96 GiB" in err


@pytest.mark.parametrize("argv, expect", [
    (["--world-size", "0"], "--world-size must be 1 or more"),
    (["--world-size", "4", "--backend", "single"], "needs ddp, fsdp2 or zero3"),
    (["--tiled", "2.5"], "--tiled 2.5"),
])
def test_bad_backend_arguments_are_named(capsys, monkeypatch, argv, expect):
    err = _error(capsys, ["plan", "--model", "llama-3.1-8b", *argv], monkeypatch)
    assert expect in err


def test_local_config_file_is_read(capsys, tmp_path):
    tiny_llama(2).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 4 and all(r["fits"] is None for r in records)
