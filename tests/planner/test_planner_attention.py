"""The attention the planner models (``tiled_mlp/planner/attention.py``, ``plan --attention``): under sdpa
and eager, a model with sliding-window layers, at a length past its window, planned to the byte of a real
CPU step running transformers' own attention; the default is what transformers picks for the config; the
plan names what it modelled; what transformers would not run is refused before any work."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig  # noqa: E402

from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.cli.main import main  # noqa: E402
from tiled_mlp.planner import attention  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import Planner, Request  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model, step_timeline  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WINDOW = 32
SEQ = 96  # past the window: transformers builds the sliding layers' mask
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, sliding_window=WINDOW)
UNTILED = Setting(tiled=False, checkpointing=False)
TILED_CKPT = Setting(tiled=True, checkpointing=True, num_shards=2)


def gemma3_like() -> Gemma3TextConfig:
    """A sliding layer, then a full one (Gemma 3's pattern, shortened)."""
    return Gemma3TextConfig(layer_types=["sliding_attention", "full_attention"], **SIZES)


def mistral_like() -> MistralConfig:
    """Every layer sliding (Mistral's ``sliding_window``)."""
    return MistralConfig(**SIZES)


def assert_planned_to_the_byte(config, setting: Setting, hf_attention: str, **request) -> None:
    """The planner's meta step against a real float32 CPU step whose model runs transformers' own
    ``hf_attention`` (its attention function and its masks), equal after every allocation."""
    planner = Planner(Request(config, [SEQ], [setting], Backend("single", 1), dtype=torch.float32, **request))
    real = build_model(config, None, torch.float32, "cpu", setting)
    real.set_attn_implementation(hf_attention)
    measured = step_timeline(real, SEQ, 1)
    predicted = planner.timeline(setting, SEQ)
    gap = (measured.peak()[0] - predicted.peak()[0]) / measured.peak()[0]
    first = next((i for i, (p, m) in enumerate(zip(predicted.points, measured.points, strict=False)) if p != m), None)
    assert first is None and len(predicted.points) == len(measured.points), (
        f"allocation {first} differs; the plan is {gap:.1%} under the real step's peak")
    assert predicted.host == measured.host


@pytest.mark.parametrize("config, setting", [(gemma3_like(), UNTILED), (mistral_like(), TILED_CKPT)],
                         ids=["gemma3-like-untiled", "mistral-like-tiled+ckpt"])
def test_sliding_window_layers_under_the_default_sdpa_are_planned_to_the_byte_of_a_real_step(config, setting):
    """Nothing said: sdpa, the sliding layers with transformers' mask, the fused kernel keeping it."""
    assert_planned_to_the_byte(config, setting, "sdpa")


@pytest.mark.parametrize("config", [gemma3_like(), mistral_like()], ids=["gemma3-like", "mistral-like"])
def test_eager_attention_is_planned_to_the_byte_of_a_real_step(config):
    assert_planned_to_the_byte(config, UNTILED, "eager", attention="eager")


def test_each_attention_holds_what_it_materialises_past_the_window():
    """At a length past the window: eager's scores over sdpa's masks over flash's nothing [tokens, tokens]."""
    config = gemma3_like()

    def peak(choice: str) -> float:
        planner = Planner(Request(config, [SEQ], [UNTILED], Backend("single", 1), dtype=torch.float32, attention=choice))
        return planner.point(UNTILED, SEQ).peak_bytes

    flash, sdpa, eager = peak(attention.FLASH), peak(attention.SDPA), peak(attention.EAGER)
    assert flash < sdpa < eager


@pytest.mark.parametrize("choice", ["sdpa", "eager"])
def test_a_model_without_sliding_windows_plans_as_flash_under_sdpa_and_more_under_eager(choice):
    """Llama under sdpa: no mask, the fused causal kernel, the flash plan's peak (its answers unchanged)."""
    config, seq = small_planner_llama(4), 512
    setting = Setting(tiled=True, checkpointing=True, num_shards=2)

    def peak(which: str) -> float:
        planner = Planner(Request(config, [seq], [setting], Backend("single", 1), dtype=torch.float32, attention=which))
        return planner.point(setting, seq).peak_bytes

    if choice == attention.SDPA:
        assert peak(choice) == peak(attention.FLASH)
    else:
        assert peak(choice) > peak(attention.FLASH)


@pytest.mark.parametrize("config", [small_planner_llama(4), gemma3_like(), mistral_like(),
                                    Gemma2Config(**SIZES), LlamaConfig(attn_implementation="eager", **SIZES)],
                         ids=["llama", "gemma3", "mistral", "gemma2", "llama-eager-in-config"])
def test_the_default_attention_is_what_transformers_picks_for_the_config(config):
    with torch.device("meta"):
        picked = AutoModelForCausalLM.from_config(config).config._attn_implementation
    assert attention.default_for(config)[0] == picked


def _plan_json(tmp_path, capsys, *extra: str) -> list:
    gemma3_like().save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq", str(SEQ), "--dtype", "fp32", "--tiled", "none",
                 "--tiled-loss", "none", "--checkpointing", "none", "--budget", "64MiB", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_names_the_attention_it_models_and_where_the_choice_came_from(tmp_path, capsys):
    default, eager = _plan_json(tmp_path, capsys), _plan_json(tmp_path, capsys, "--attention", "eager")
    assert (default[0]["attention"], default[0]["attention_from"]) == ("sdpa", "transformers' default for Gemma3ForCausalLM")
    assert (eager[0]["attention"], eager[0]["attention_from"]) == ("eager", "--attention")
    assert eager[1]["peak_bytes"] > default[1]["peak_bytes"]
    assert main(["plan", "--model", str(tmp_path), "--seq", str(SEQ), "--dtype", "fp32", "--tiled", "none",
                 "--tiled-loss", "none", "--checkpointing", "none", "--budget", "64MiB"]) == 0
    captured = capsys.readouterr()
    assert "modelled attention (transformers' default for Gemma3ForCausalLM): sdpa: " in captured.out
    assert f"sliding-window layers, from {WINDOW:,} tokens" in captured.out
    assert "flash kernel" not in captured.err  # no warning: what runs is modelled


@pytest.mark.parametrize("config, extra, expected", [
    (Gemma2Config(**SIZES), ["--attention", "sdpa"], "Gemma2ForCausalLM does not support attn_implementation='sdpa'"),
    (Gemma3TextConfig(attn_logit_softcapping=50.0, **SIZES), [], "sdpa does not support the config's attention softcapping"),
    (small_planner_llama(4), ["--attention", "eager", "--sp", "2", "--world-size", "2"], "--sp 2 with eager attention"),
    (mistral_like(), ["--sp", "2", "--world-size", "2"], "--sp 2 with sdpa on a model with sliding-window layers"),
], ids=["no-sdpa-in-the-class", "sdpa-with-softcapping", "eager-under-sp", "sliding-sdpa-under-sp"])
def test_an_attention_transformers_would_not_run_is_refused_before_any_work(tmp_path, capsys, config, extra, expected):
    config.save_pretrained(tmp_path)
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(tmp_path), "--seq", "1024", "--budget", "64MiB", *extra])
    assert expected in capsys.readouterr().err
