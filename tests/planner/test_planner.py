"""The whole-model planner (``tiled-mlp plan --model``): its prediction against the measured peak of
the real step, its search, its output, and its errors before any work. Full depth, layer kinds and
monotonicity on every preset: ``test_planner_depth.py``; the search alone: ``test_planner_search.py``."""
from __future__ import annotations

import json

import pytest
import torch
from cli_errors import usage_error

pytest.importorskip("transformers")


from integration_tests.tiny_models import planner_llama  # noqa: E402
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
# The tiled loss's settings (its real steps: ``test_planner_loss.py``), here for the search.
LOSS_SETTINGS = {
    "tiled-loss": Setting(tiled=False, checkpointing=False, tiled_loss=True, loss_num_shards=4),
    "tiled+tiled-loss+ckpt": Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_prediction_matches_the_measured_real_step_to_the_byte(name):
    """Predicted: the meta-device step at full depth. Measured: the real 3-layer step on the CPU (fp32,
    random weights and tokens), with the same exact live-storage tracker. To the byte: the meta step
    remakes repeated ops' outputs from their metadata (``meta_outputs.py``), which must change nothing."""
    setting, config, seq = SETTINGS[name], planner_llama(3), 1024
    planner = Planner(Request(config, [seq], [setting], Backend("single", 1), dtype=torch.float32))
    predicted = planner.point(setting, seq).peak_bytes
    real = build_model(config, 3, torch.float32, "cpu", setting)
    measured, _ = step_timeline(real, seq, 1).peak()
    assert predicted == measured
    if setting.tiled:
        assert all(m.tiling.last_num_shards == 4 for m in real.modules() if hasattr(m, "tiling"))


def test_the_search_is_certified_and_agrees_with_the_table():
    config = planner_llama(4)
    settings = list({**SETTINGS, **LOSS_SETTINGS}.values())
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
    # Tiling (the MLPs, the loss) and checkpointing only ever lengthen what fits.
    assert longest["tiled"] >= longest["untiled"] and longest["untiled+ckpt"] >= longest["untiled"]
    assert longest["tiled-loss"] >= longest["untiled"] and longest["tiled+tiled-loss+ckpt"] >= longest["tiled+ckpt"]


def test_the_cap_is_not_reported_as_the_answer():
    config = planner_llama(2)
    setting = SETTINGS["untiled+ckpt"]
    planner = Planner(Request(config, [], [setting], Backend("single", 1), dtype=torch.float32, budget=2**40,
                              seq_step=1024, seq_cap=4096))
    found = planner.longest(setting)
    assert found.seq == 4096 and found.at_cap


def test_sharding_divides_weights_gradients_and_optimizer_and_the_peak_may_move():
    """Under FSDP2 over 8 ranks the rank's share of the gradients shrinks, so the step's peak moves from
    the end of the backward (every gradient alive) to the loss (the most activations): the timeline
    is re-read with the shares, not the single rank's peak divided."""
    config = load_config("llama-3.1-8b")
    setting = Setting(tiled=True, checkpointing=True)
    one = Planner(Request(config, [8192], [setting], Backend("single", 1))).point(setting, 8192)
    eight = Planner(Request(config, [8192], [setting], Backend("fsdp2", 8))).point(setting, 8192)
    assert eight.optimizer_bytes == pytest.approx(one.optimizer_bytes / 8)
    assert eight.parts["weights"] == pytest.approx(one.parts["weights"] / 8)
    assert one.parts["gradients"] > 0.9 * one.parts["weights"], "one rank: near the end of the backward"
    assert eight.parts["gradients"] < eight.parts["weights"], "eight ranks: a moment with fewer gradients"
    moved = eight.parts["activations"] + eight.parts["logits and loss"]
    assert moved > one.parts["activations"] + one.parts["logits and loss"]
    assert eight.parts["backend in flight"] > 0


def test_json_records_and_the_longest_sequence(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--seq", "4096,8192", "--world-size", "8", "--backend", "fsdp2",
                 "--budget", "80GiB", "--checkpointing", "none", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[0] == {"budget_bytes": 80 * 2**30, "budget_from": "--budget", "host_budget_bytes": None,
                          "attention": "sdpa", "attention_from": "transformers' default for LlamaForCausalLM",
                          "attention_kernel": "sdpa_flash", "tensor_parallel": 1, "data_parallel": 8}
    points = [r for r in records if "seq" in r]
    assert {r["setting"] for r in points} == {"untiled", "tiled", "tiled-loss", "tiled+tiled-loss"} and len(points) == 8
    for r in points:
        assert r["held_bytes"] == r["peak_bytes"] + r["optimizer_bytes"] and r["optimizer_on_device"]
        assert r["fits"] == (r["held_bytes"] <= 80 * 2**30)
        assert sum(r["parts"].values()) == pytest.approx(r["held_bytes"], abs=8)
    longest = {r["setting"]: r["max_seq"] for r in records if "max_seq" in r}
    assert set(longest) == {"untiled", "tiled", "tiled-loss", "tiled+tiled-loss"}
    assert longest["tiled-loss"] >= longest["untiled"] and longest["tiled+tiled-loss"] >= longest["tiled"]
    for r in points:
        assert r["fits"] == (r["seq"] <= longest[r["setting"]])


def test_the_table_shows_the_total_fits_judges_and_names_the_tiled_loss_where_logits_dominate(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--seq", "65536", "--checkpointing", "layer", "--tiled", "none",
                 "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "logits and loss" in out and "apply_tiled_mlp(model, loss=True)" in out and "analytic" in out
    assert "| 65536 | untiled+ckpt |" in out and "| 65536 | tiled-loss+ckpt |" in out and "'tiled-loss' computes" in out
    assert "| step peak | optimizer | held | fits |" in out and "'held' is what 'fits' judges" in out
    assert "budget 80.00 GiB (default: " in out


def test_when_nothing_fits_the_plan_says_what_to_change(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--budget", "80GiB", "--checkpointing", "layer", "--tiled", "none",
                 "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "none (not even 1024 tokens)" in out and "nothing fits 80.00 GiB per rank" in out
    assert "--offload-optimizer" in out, "the optimizer is on the device: offloading it is a knob"
    assert "--world-size 8 --backend fsdp2" in out, "the fewest ranks that fit, by the plan's own model"
    assert "the dominant term, optimizer" in out


def test_the_default_budget_is_the_gpu_else_a_stated_80_gib(monkeypatch):
    from tiled_mlp.cli import plan_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_model.default_budget() == (80 * 2**30, "default: no CUDA device here, so 80 GiB (an H100's); set --budget")

    class H200:
        total_memory, name = 150_000_000_000, "NVIDIA H200"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H200)
    budget, source = plan_model.default_budget()
    assert budget == 150_000_000_000 and "cuda:0" in source and "H200" in source


@pytest.mark.parametrize("text, expect", [("80", 80 * 2**30), ("80GiB", 80 * 2**30), ("80gib", 80 * 2**30),
                                          ("80GB", 80 * 10**9), ("1.5TB", 1.5 * 10**12), ("512MiB", 2**29),
                                          ("4096B", 4096)])
def test_budget_sizes_read_like_accelerates_max_memory(text, expect):
    """GiB powers of 2, GB powers of 10 (accelerate.utils.convert_file_size_to_int); a bare number is GiB."""
    from tiled_mlp.cli.main import build_parser

    assert build_parser().parse_args(["plan", "--budget", text]).budget == expect


@pytest.mark.parametrize("text, expect", [("80G", "could mean GB or GiB"), ("80Gb", "reads a lowercase b as bits"),
                                          ("80gb", "write 80GB or 80GiB"), ("lots", "80GiB (80 x 2^30 bytes)"),
                                          ("0", "must be positive")])
def test_other_budget_forms_are_refused_with_the_accepted_ones(capsys, text, expect):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-3.1-8b", "--budget", text])
    err = capsys.readouterr().err
    assert "argument --budget" in err and expect in err


def test_lengths_past_max_position_embeddings_are_warned(capsys, tmp_path):
    planner_llama(2).save_pretrained(tmp_path)  # max_position_embeddings 4096
    assert main(["plan", "--model", str(tmp_path), "--seq", "2048,8192", "--dtype", "fp32", "--tiled", "none",
                 "--budget", "64MiB", "--json"]) == 0
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith("warning: ") and "8,192" in line and "2,048" not in line
    assert "past the model's max_position_embeddings (4,096)" in line


def test_a_dip_in_the_modelled_total_is_warned():
    from tiled_mlp.planner.plan import Point
    from tiled_mlp.planner.report import dips

    points = [Point(seq, "tiled", held, 0.0, {}) for seq, held in ((2048, 30 * 2**30), (3072, 28 * 2**30),
                                                                       (4096, 29 * 2**30))]
    (line,) = dips(points)
    assert "tiled holds less at 3072 tokens (28.00 GiB) than at 2048 (30.00 GiB)" in line and "--tiled N" in line
    loss_only = [Point(p.seq, "tiled-loss", p.held_bytes, 0.0, {}) for p in points]
    (line,) = dips(loss_only)
    assert "--tiled N" not in line, "'tiled-loss' alone tiles no MLP: auto's pass-through is not the cause"


def test_the_longest_lines_never_present_the_cap_as_the_answer():
    from tiled_mlp.planner.report import longest_lines
    from tiled_mlp.planner.search import Longest

    lines = longest_lines({"a": Longest(2**20, True), "b": Longest(8192, False), "c": Longest(0, False)}, 2**30)
    assert "at least 1,048,576 tokens (where the search stops)" in lines[1]
    assert lines[2].split()[1] == "8,192" and "none (not even 1024 tokens)" in lines[3]


# -- errors before any step is modelled -------------------------------------------------------------------
def _error(capsys, argv, monkeypatch) -> str:
    from tiled_mlp.planner import check

    def no_work(*args, **kwargs):
        raise AssertionError("a step was modelled before the arguments were checked")

    monkeypatch.setattr(plan_module, "step_timeline", no_work)
    monkeypatch.setattr(check, "step_timeline", no_work)
    return usage_error(capsys, argv)


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
    (["--tiled-loss", "2.5"], "--tiled-loss 2.5"),
])
def test_bad_backend_arguments_are_named(capsys, monkeypatch, argv, expect):
    err = _error(capsys, ["plan", "--model", "llama-3.1-8b", *argv], monkeypatch)
    assert expect in err


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_moe_experts_outside_bfloat16_are_refused(capsys, monkeypatch, dtype):
    err = _error(capsys, ["plan", "--model", "qwen3-30b-a3b", "--dtype", dtype], monkeypatch)
    assert f"--dtype {dtype}" in err and "grouped_mm" in err and "use --dtype bfloat16" in err


def _saved(tmp_path, config) -> str:
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("make", [
    lambda: __import__("transformers").T5Config(d_model=64, num_layers=2, d_ff=128, num_heads=4, d_kv=16, vocab_size=512),
    lambda: __import__("transformers").BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=128, vocab_size=512),
], ids=["t5", "bert"])
def test_encoders_and_encoder_decoders_are_refused(capsys, monkeypatch, tmp_path, make):
    err = _error(capsys, ["plan", "--model", _saved(tmp_path, make())], monkeypatch)
    assert "is not a decoder-only language model" in err and "llama" in err


@pytest.mark.parametrize("change, expect", [
    ({"hidden_size": 100, "num_attention_heads": 8}, "cannot exist: The hidden size (100) is not a multiple"),
    ({"num_key_value_heads": 3}, "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    ({"intermediate_size": 0}, "intermediate_size = 0; every size must be 1 or more"),
])
def test_impossible_shapes_are_refused(capsys, monkeypatch, tmp_path, change, expect):
    values = {**planner_llama(2).to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(values))
    err = _error(capsys, ["plan", "--model", str(tmp_path)], monkeypatch)
    assert expect in err


def test_learned_positions_cap_the_length(capsys, monkeypatch, tmp_path):
    from transformers import GPT2Config

    path = _saved(tmp_path, GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=1024,
                                       bos_token_id=0, eos_token_id=0))
    err = _error(capsys, ["plan", "--model", path, "--seq", "2048", "--dtype", "fp32"], monkeypatch)
    assert "learned position embeddings for 1024 tokens" in err and "--seq up to 1024" in err


def test_local_config_file_is_read(capsys, tmp_path):
    planner_llama(2).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
                 "--budget", "64MiB", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert len(records) == 9 and all(r["fits"] for r in records if "seq" in r)


def test_a_config_with_yarn_is_not_told_it_needs_position_scaling():
    from tiled_mlp.planner.report import position_warnings

    config = planner_llama(2)
    config.rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    if getattr(config, "rope_parameters", None) is not None:
        config.rope_parameters = dict(config.rope_scaling)
    assert position_warnings(config, [8192, 16384], {}) == []  # within 4 x 4096
    (line,) = position_warnings(config, [32768], {})
    assert "needs position scaling" not in line and "YaRN scaling covers (factor 4.0 over 4,096)" in line


def test_verify_full_depth_checks_each_answer_again_and_gives_the_same_plan(capsys, tmp_path, monkeypatch):
    # Off by default (the composition is proven in test_planner_compose.py); the flag runs the check, and the
    # header says which was done.
    from tiled_mlp.planner import plan as plan_module

    planner_llama(4).save_pretrained(tmp_path)
    checked = []
    agrees = plan_module.Planner._full_depth_agrees
    monkeypatch.setattr(plan_module.Planner, "_full_depth_agrees",
                        lambda self, setting, found: checked.append(setting) or agrees(self, setting, found))
    argv = ["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
            "--budget", "256MiB", "--workers", "1"]
    outputs = []
    for extra in ([], ["--verify-full-depth"]):
        assert main(argv + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert checked, "--verify-full-depth ran no full-depth check"
    plain, verified = (out.splitlines() for out in outputs)
    assert "--verify-full-depth models each answer again" in plain[0]
    assert "each longest length modelled again at full depth" in verified[0]
    assert plain[1:] == verified[1:]
