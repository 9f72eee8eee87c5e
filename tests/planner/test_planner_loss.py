"""The tiled loss as a setting of the whole-model planner (``tiled-mlp plan --model``): its modelled
step equals the real CPU step to the byte at every allocation, not only at the peak (a 3-layer Llama
in float32, a 12-layer Qwen3-MoE of mixed layer kinds in bfloat16), it never holds more than one
shard's logits, the logits term leaves the 8B plan, and Llama-3.1-8B reaches 131072 tokens on one
80 GiB GPU with the MLPs and the loss tiled and every layer checkpointed."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


from integration_tests.tiny_models import planner_llama, planner_mixed_moe  # noqa: E402
from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.presets import load_config  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model, step_timeline  # noqa: E402
from tiled_mlp.planner.timeline import LOGITS  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GiB = 2**30
SEQ, LOSS_SHARDS = 1024, 4
# Fixed shard counts: at 1024 tokens "auto" would run the tiny models' loss in one shard.
LOSS_SETTINGS = {s.name: s for s in (Setting(tiled=tiled, checkpointing=ckpt, num_shards=4, tiled_loss=True,
                                             loss_num_shards=LOSS_SHARDS)
                                     for ckpt in (False, True) for tiled in (False, True))}


def _assert_predicted_to_the_byte(config, setting: Setting, dtype: torch.dtype) -> None:
    """The planner's full-depth meta step against the real one on the CPU: the same peak, and the same
    (weights, gradients, logits, activations) after every allocation of the step. The whole timeline,
    because a term the step no longer holds at its peak (the loss's input gradient, freed once the
    final norm's backward has used it) would still be wrong in a plan where it is."""
    planner = Planner(Request(config, [SEQ], [setting], Backend("single", 1), dtype=dtype))
    real = build_model(config, None, dtype, "cpu", setting)
    assert is_tiled_loss(planner.model(setting)) and is_tiled_loss(real), "the integration's tiled loss runs"
    measured = step_timeline(real, SEQ, 1)
    assert planner.point(setting, SEQ).peak_bytes == measured.peak()[0]
    predicted = planner.timeline(setting, SEQ).points
    first = next((i for i, (p, m) in enumerate(zip(predicted, measured.points, strict=False)) if p != m), None)
    assert first is None and len(predicted) == len(measured.points), (
        f"allocation {first}: predicted {predicted[first] if first is not None else len(predicted)}, "
        f"measured {measured.points[first] if first is not None else len(measured.points)}")


@pytest.mark.parametrize("name", list(LOSS_SETTINGS))
def test_a_real_llama_step_with_the_tiled_loss_is_predicted_to_the_byte(name):
    _assert_predicted_to_the_byte(planner_llama(3), LOSS_SETTINGS[name], torch.float32)


@pytest.mark.parametrize("name", list(LOSS_SETTINGS))
def test_a_real_12_layer_mixed_moe_step_with_the_tiled_loss_is_predicted_to_the_byte(name):
    """Seven dense and five MoE layers at full depth, bfloat16 (logits upcast to float32 per shard)."""
    _assert_predicted_to_the_byte(planner_mixed_moe(12), LOSS_SETTINGS[name], torch.bfloat16)


@pytest.mark.parametrize("ckpt", [False, True], ids=["", "ckpt"])
def test_the_tiled_loss_never_holds_more_than_one_shards_logits(ckpt):
    """Over the whole modelled step, the most logits alive at once: the model's own loss holds all
    [1024, 512] float32 logits several times over; the tiled loss one shard's ([256, 512] float32)."""
    config = planner_llama(3)
    own = Setting(tiled=False, checkpointing=ckpt)
    tiled = Setting(tiled=False, checkpointing=ckpt, tiled_loss=True, loss_num_shards=LOSS_SHARDS)
    most = {}
    for setting in (own, tiled):
        timeline = step_timeline(build_model(config, None, torch.float32, "meta", setting), SEQ, 1)
        most[setting.name] = max(logits for _, _, logits, _ in timeline.points)
    vocab = config.vocab_size
    assert most[tiled.name] == SEQ // LOSS_SHARDS * vocab * 4
    assert most[own.name] >= 2 * SEQ * vocab * 4


def test_the_logits_term_leaves_the_8b_plan():
    """Llama-3.1-8B at 32768 tokens, checkpointed: the logits and the loss dominate the model's own
    step (66%); with the tiled loss they are no term at the peak and the weights dominate."""
    config = load_config("llama-3.1-8b")
    own, tiled = Setting(tiled=True, checkpointing=True), Setting(tiled=True, checkpointing=True, tiled_loss=True)
    planner = Planner(Request(config, [32768], [own, tiled], Backend("single", 1), budget=80 * GiB,
                              optimizer_on_device=False))
    assert planner.point(own, 32768).dominant == LOGITS
    point = planner.point(tiled, 32768)
    assert point.parts[LOGITS] <= 2 * GiB and point.dominant == "weights"
    assert point.held_bytes < planner.point(own, 32768).held_bytes / 2


def test_llama_8b_fits_131072_tokens_on_one_80_gib_gpu_with_mlps_and_loss_tiled():
    """The optimizer on the host, layer checkpointing, MLPs and loss tiled: under 70 GiB held, and the
    logits term under 1 GiB."""
    config = load_config("llama-3.1-8b")
    setting = Setting(tiled=True, checkpointing=True, tiled_loss=True)
    planner = Planner(Request(config, [131072], [setting], Backend("single", 1), budget=80 * GiB,
                              optimizer_on_device=False))
    point = planner.point(setting, 131072)
    assert point.fits and point.held_bytes < 70 * GiB and point.parts[LOGITS] < 1 * GiB


def test_setting_names_join_the_tiling_the_tiled_loss_and_ckpt_in_that_order():
    names = [Setting(tiled=t, checkpointing=c, tiled_loss=loss).name
             for c in (False, True) for loss in (False, True) for t in (False, True)]
    assert names == ["untiled", "tiled", "tiled-loss", "tiled+tiled-loss",
                     "untiled+ckpt", "tiled+ckpt", "tiled-loss+ckpt", "tiled+tiled-loss+ckpt"]


def test_the_cli_plans_the_tiled_loss_beside_the_models_own(capsys, tmp_path):
    planner_llama(2).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
                 "--tiled-loss", "4", "--budget", "64MiB", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    settings = [r["setting"] for r in records if "seq" in r]
    assert settings == ["untiled", "tiled-loss", "untiled+ckpt", "tiled-loss+ckpt"]
    assert all(r["dominant"] != LOGITS for r in records if "seq" in r and "tiled-loss" in r["setting"])


def _gpt2(tmp_path) -> str:
    from transformers import GPT2Config

    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=1024, bos_token_id=0,
               eos_token_id=0).save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_family_without_the_tiled_loss_path_is_planned_without_it_and_said_so(capsys, tmp_path):
    assert main(["plan", "--model", _gpt2(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
                 "--checkpointing", "layer", "--budget", "64MiB", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["setting"] for r in json.loads(captured.out) if "seq" in r] == ["untiled+ckpt"]
    assert "warning: the tiled-loss settings are left out: tiled loss: no known causal LM in GPT2LMHeadModel" \
        in captured.err


def test_asking_for_the_tiled_loss_on_such_a_family_is_refused_before_any_step(capsys, monkeypatch, tmp_path):
    from tiled_mlp.planner import check
    from tiled_mlp.planner import plan as plan_module

    def no_work(*args, **kwargs):
        raise AssertionError("a step was modelled before the arguments were checked")

    monkeypatch.setattr(plan_module, "step_timeline", no_work)
    monkeypatch.setattr(check, "step_timeline", no_work)
    with pytest.raises(SystemExit):
        main(["plan", "--model", _gpt2(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled-loss", "auto"])
    err = capsys.readouterr().err
    assert "--tiled-loss auto: tiled loss: no known causal LM" in err and "give --tiled-loss none" in err


def test_a_tiled_loss_that_fails_on_the_meta_device_is_left_out_said_so_or_refused_when_asked(capsys, monkeypatch,
                                                                                          tmp_path):
    """The tiled loss is other code than the model's: where its short meta step fails, the plan keeps
    the rows without it (and says why), unless --tiled-loss asked for it."""
    from tiled_mlp.integrations import causal_lm_loss

    def broken(*args, **kwargs):
        raise RuntimeError("no meta kernel for this")

    monkeypatch.setattr(causal_lm_loss, "tiled_cross_entropy", broken)
    planner_llama(2).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--seq", "1024", "--dtype", "fp32", "--tiled", "none",
            "--checkpointing", "layer", "--budget", "64MiB", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert [r["setting"] for r in json.loads(captured.out) if "seq" in r] == ["untiled+ckpt"]
    assert "the tiled-loss settings are left out: with the tiled loss" in captured.err
    assert "fails on the meta device: no meta kernel for this" in captured.err
    with pytest.raises(SystemExit):
        main(argv + ["--tiled-loss", "auto"])
    assert "--tiled-loss auto: with the tiled loss" in capsys.readouterr().err
