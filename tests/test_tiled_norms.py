"""Tiled RMSNorms: ``apply_tiled_mlp(model, norms=True)`` tiles a decoder's RMSNorms (each layer's two and
the final one, found by class and structure) on the norm kernel (a registered body). Exact in float64 (loss or logits, the
input's gradient, every parameter's) against the untiled model, with and without Hugging Face's
non-reentrant checkpointing, beside the tiled MLPs and the tiled loss; "auto" tiles every norm call
(~hidden tokens a shard: a norm has no intermediate size); and the planner's '+norms' setting is a real
CPU step to the byte at every allocation, device and host."""
from __future__ import annotations

import copy
import types
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from planner_checks import predicted_to_the_byte  # noqa: E402

from integration_tests.comparison import float_kept_float64  # noqa: E402
from integration_tests.tiny_models import (  # noqa: E402
    VOCAB,
    grads_by_key,
    planner_llama,  # noqa: E402
    tiny_model,
)
from tiled_mlp.core import TiledMLP  # noqa: E402
from tiled_mlp.core.auto_shards import MLPSize, auto_decision  # noqa: E402
from tiled_mlp.integrations import apply_tiled_mlp, remove_tiled_mlp  # noqa: E402
from tiled_mlp.integrations.norms import norm_names  # noqa: E402
from tiled_mlp.planner.backends import Backend  # noqa: E402
from tiled_mlp.planner.plan import OFFLOADED, Planner, Request  # noqa: E402
from tiled_mlp.planner.step import Setting  # noqa: E402

pytestmark = pytest.mark.timeout(120)

NORMS = ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
         "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
BATCH, SEQ, HIDDEN = 2, 24, 16  # 48 tokens of hidden 16: "auto" tiles a norm call into 3 shards


def _ids_and_embeds(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    embeds = torch.randn(BATCH, SEQ, HIDDEN, generator=generator, dtype=torch.float64)
    return ids, embeds


def _checkpointed(model, on: bool):
    model.train()
    if on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _norms_of(model):
    return {name: module for name, module in model.named_modules() if name in NORMS}


def _embeds_step(model, ids, embeds, loss: bool, reference: bool = False):
    """One forward and backward from ``inputs_embeds`` (so the input has a gradient): the loss, or the
    logits against fixed random weights; returns (the output, the input's gradient). The reference loss
    is Hugging Face's ForCausalLMLoss on the logits kept in float64 (its ``.float()`` patched for the
    comparison, as ``test_hf_loss.py`` does)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    x = embeds.clone().requires_grad_(True)
    if loss and reference:
        logits = model(inputs_embeds=x).logits
        with float_kept_float64():
            out = ForCausalLMLoss(logits, ids, VOCAB)
        out.backward()
    elif loss:
        out = model(inputs_embeds=x, labels=ids).loss
        out.backward()
    else:
        out = model(inputs_embeds=x).logits
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * weights).sum().backward()
    return out.detach(), x.grad


def _assert_exact(reference, tiled, ids, embeds, loss: bool) -> None:
    want, want_grad = _embeds_step(reference, ids, embeds, loss, reference=True)
    got, got_grad = _embeds_step(tiled, ids, embeds, loss)
    assert (got - want).abs().max().item() <= 1e-12
    assert (got_grad - want_grad).abs().max().item() <= 1e-12
    want_grads, got_grads = grads_by_key(reference), grads_by_key(tiled)
    assert want_grads.keys() == got_grads.keys()
    for key, g in want_grads.items():
        if g is None:
            assert got_grads[key] is None, key
            continue
        assert (got_grads[key] - g).abs().max().item() <= 1e-12, key


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_norms_are_found_by_class_and_structure(family):
    model = tiny_model(family)
    assert norm_names(model) == NORMS
    report = apply_tiled_mlp(model, norms=True)
    tiled = {block.name: block for block in report.patched}
    assert set(tiled) == set(NORMS) | {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert all(tiled[name].kind == "norm" and isinstance(tiled[name].tiled, TiledMLP) for name in NORMS)
    assert str(report).startswith("tiled-mlp: tiled 2 MLP block(s) and 5 norm(s), 0 already tiled, ")
    assert norm_names(model) == [], "a tiled norm is not found again"
    assert apply_tiled_mlp(model, norms=True).patched == [], "applying twice is harmless"
    assert sorted(remove_tiled_mlp(model)) == sorted(tiled)
    assert type(model.model.norm).__name__ == f"{family.capitalize()}RMSNorm"


def test_the_report_says_the_norm_kernel_runs_a_registered_norm_and_generic_otherwise():
    """What the report expects before the first forward is what ``last_path`` says after it."""
    model = tiny_model("llama")
    own = model.model.layers[0].input_layernorm
    own.forward = types.MethodType(lambda self, x: type(self).forward(self, x), own)  # no registered body
    report = apply_tiled_mlp(model, norms=True, num_shards=2)
    norms = {block.name: block for block in report.patched if block.kind == "norm"}
    odd = norms.pop("model.layers.0.input_layernorm")
    assert {block.expected_path for block in norms.values()} == {"norm (a registered RMSNorm forward: the norm kernel)"}
    assert odd.expected_path.startswith("generic (")
    assert "norm(s)" in str(report) and "it is a norm, not a gated MLP" not in str(report)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert {block.last_path for block in norms.values()} == {"norm"} and odd.last_path == "generic"


def test_only_hidden_sized_rmsnorms_are_norms_and_exclude_applies():
    """Qwen3's per-head q_norm/k_norm (head size 8) are left alone; ``exclude`` keeps a norm untiled and
    ``include=[]`` tiles the norms alone; ``path="fast"`` is the MLPs', the norms run generic."""
    qwen3 = tiny_model("qwen3")
    assert norm_names(qwen3) == NORMS
    llama = tiny_model("llama")
    report = apply_tiled_mlp(llama, include=[], norms=True, exclude="model.norm", path="fast")
    assert [b.name for b in report.patched] == NORMS[:-1] and report.skipped == [("model.norm", "excluded by pattern")]
    assert all(b.tiled.tiling.path == "auto" for b in report.patched)


@pytest.mark.parametrize("num_shards", ["auto", 5])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-ckpt"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiled_norms_mlps_and_loss_are_exact_in_float64(family, checkpointing, num_shards):
    """Loss, input gradient and every parameter's gradient within 1e-12 of the untiled model; the norms ran
    the generic path, in 3 shards under "auto" (48 tokens, ~16 a shard), in the layers' recompute too."""
    reference = _checkpointed(tiny_model(family), checkpointing)
    tiled = _checkpointed(copy.deepcopy(reference), checkpointing)
    report = apply_tiled_mlp(tiled, num_shards=num_shards, norms=True, loss=True, loss_num_shards=3)
    assert report.tiled_loss and len(report.patched) == len(NORMS) + 2
    ids, embeds = _ids_and_embeds()
    _assert_exact(reference, tiled, ids, embeds, loss=True)
    for name, norm in _norms_of(tiled).items():
        assert norm.tiling.last_path == "norm", name
        assert norm.tiling.last_num_shards == (3 if num_shards == "auto" else 5), name


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "hf-ckpt"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiled_norms_alone_give_the_same_logits(family, checkpointing):
    reference = _checkpointed(tiny_model(family), checkpointing)
    tiled = _checkpointed(copy.deepcopy(reference), checkpointing)
    apply_tiled_mlp(tiled, include=[], num_shards=4, norms=True)
    ids, embeds = _ids_and_embeds(3)
    _assert_exact(reference, tiled, ids, embeds, loss=False)
    assert {n.tiling.last_path for n in _norms_of(tiled).values()} == {"norm"}


def test_auto_tiles_a_long_norm_call_hidden_tokens_a_shard():
    """A norm has no intermediate size, so "auto" takes ~hidden tokens a shard: 500,000 tokens of a
    4096-wide bfloat16 norm are 123 shards (a shard's float32 copy 64 MiB, where the whole call's is
    7.6 GiB); the 48-token call of the tests above, 3 shards; a call of no more than hidden tokens (one
    shard: a step of generation) runs untiled."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    size = MLPSize(4096, None, 4096 * 2, 2, generic_trainable_bytes=4096 * 2)
    decision = auto_decision(500_000, size)
    assert decision.num_shards == 123 and "intermediate size is unknown" in decision.reason
    assert auto_decision(48, MLPSize(16, None, 16 * 8, 8, 16 * 8)).num_shards == 3
    with torch.device("meta"):
        norm = LlamaRMSNorm(4096).to(torch.bfloat16)
        x = torch.empty(1, 500_000, 4096, dtype=torch.bfloat16, requires_grad=True)
    TiledMLP(norm)
    norm(x).sum().backward()
    assert norm.tiling.last_path == "norm" and norm.tiling.last_num_shards == 123
    assert auto_decision(4096, size).num_shards is None
    norm(x[:, :4096]).sum().backward()
    assert norm.tiling.last_path == "untiled" and "no more than the hidden size" in norm.tiling.last_reason


def test_zero3_partitioned_norms_are_found_by_their_full_shape():
    """Under ZeRO-3 a parameter's tensor is empty and its shape ``ds_shape`` (as HF's loading under
    ZeRO-3 leaves it): the norms are found all the same."""
    model = tiny_model("llama")
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0, dtype=param.dtype)
    assert norm_names(model) == NORMS


def test_the_hidden_size_through_peft_and_none_without_it():
    """A LoRA on the embeddings hides their width behind PEFT's wrapper: read through it (Qwen3's
    per-head norms stay untiled). A model that says no hidden size gets no norm tiled, and the report says
    why, rather than every RMSNorm."""
    peft = pytest.importorskip("peft")
    qwen3 = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(target_modules=["q_proj", "embed_tokens"], r=2))
    assert [name.removeprefix("base_model.model.") for name in norm_names(qwen3)] == NORMS

    model = tiny_model("llama")
    with mock.patch("tiled_mlp.integrations.norms.hidden_size", return_value=None):
        assert norm_names(model) == []
        report = apply_tiled_mlp(model, norms=True)
    assert {b.kind for b in report.patched} == {"gated"} and report.skipped[-1][0] == "norms"
    assert "hidden size is unknown" in report.skipped[-1][1]


def test_a_norm_inside_a_tiled_block_is_tiled_with_it_not_again():
    model = tiny_model("llama")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model.model.layers[0].mlp.inner_norm = LlamaRMSNorm(HIDDEN)
    assert "model.layers.0.mlp.inner_norm" in norm_names(model)
    report = apply_tiled_mlp(model, norms=True)
    assert "model.layers.0.mlp.inner_norm" not in [b.name for b in report.patched]
    assert "model.layers.0.mlp.inner_norm" not in norm_names(model)


def test_norm_weight_gradients_are_summed_in_float32_or_wider():
    """A norm's weight gradient is a sum over every token: float32 by default (bf16 over many shards
    tripled its error), the caller's dtype where it is wider."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    report = apply_tiled_mlp(model, norms=True)
    kinds = {b.kind: b.tiled.tiling.grad_accum_dtype for b in report.patched}
    assert kinds == {"norm": torch.float32, "gated": None}
    model = tiny_model("llama")
    report = apply_tiled_mlp(model, norms=True, grad_accum_dtype=torch.float64)
    assert {b.tiled.tiling.grad_accum_dtype for b in report.patched} == {torch.float64}


def test_applying_twice_says_nothing_and_a_model_without_rmsnorm_says_so():
    model = tiny_model("llama")
    apply_tiled_mlp(model, norms=True)
    assert apply_tiled_mlp(model, norms=True).skipped == []
    model = tiny_model("gemma")
    with mock.patch("tiled_mlp.integrations.norms.is_norm", return_value=False):
        report = apply_tiled_mlp(model, norms=True)
    assert report.skipped == [("norms", "no RMSNorm of the hidden size outside the tiled blocks")]


# -- the planner's '+norms' setting ---------------------------------------------------------------------
PLANNED = {s.name: s for s in (
    Setting(tiled=False, checkpointing=True, tiled_norms=True, num_shards=4),
    Setting(tiled=True, checkpointing=False, num_shards=4, tiled_loss=True, loss_num_shards=4, tiled_norms=True),
    Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4, tiled_norms=True,
            offload_checkpoints=True),
)}


def test_setting_names():
    assert list(PLANNED) == ["norms+ckpt", "tiled+tiled-loss+norms", "tiled+tiled-loss+norms+ckpt+offload"]
    assert Setting(tiled=True, checkpointing=True, tiled_loss=True, offload_checkpoints=True, sp=8,
                   tiled_norms=True).name == "tiled+tiled-loss+norms+ckpt+offload+sp8"


@pytest.mark.parametrize("name", list(PLANNED))
def test_a_real_step_with_tiled_norms_is_predicted_to_the_byte(name):
    """The modelled (meta) step against a real 3-layer float32 step on the CPU: the same (weights,
    gradients, logits, activations) after every allocation, and the same host memory; the norms ran tiled
    in both."""
    setting, config, seq = PLANNED[name], planner_llama(3), 1024
    planner, real, measured = predicted_to_the_byte(setting, config, seq)
    assert planner.point(setting, seq).peak_bytes == measured.peak()[0]
    for model in (real, planner.model(setting)):
        norms = [m for n, m in model.named_modules() if n.endswith("layernorm") or n == "model.norm"]
        assert len(norms) == 7 and all(m.tiling.last_path == "norm" and m.tiling.last_num_shards == 4
                                       for m in norms)
    if setting.offload_checkpoints:
        assert planner.point(setting, seq).host_parts[OFFLOADED] == 2 * seq * config.hidden_size * 4


def test_tiled_norms_lower_the_modelled_peak():
    """Same tiny model, 4096 tokens, float32: the tiled norms' step holds less than the untiled norms'."""
    config, seq = planner_llama(3), 4096
    plain = Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4)
    norms = Setting(tiled=True, checkpointing=True, num_shards=4, tiled_loss=True, loss_num_shards=4, tiled_norms=True)
    planner = Planner(Request(config, [seq], [plain, norms], Backend("single", 1), dtype=torch.float32))
    assert planner.point(norms, seq).peak_bytes < planner.point(plain, seq).peak_bytes


def test_plan_puts_the_tiled_norms_beside_each_tiled_setting(capsys, tmp_path):
    """``tiled-mlp plan --tiled-norms``: '+norms' beside each setting with tiled MLPs, holding less at 4096
    tokens than the same setting without; with ``--tiled none`` there is nothing to put it beside."""
    import json

    from tiled_mlp.cli.main import main

    planner_llama(3).save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--seq", "4096", "--dtype", "fp32", "--tiled-loss", "none",
            "--checkpointing", "layer", "--budget", "1GiB"]
    assert main(argv + ["--tiled", "4", "--tiled-norms", "--json"]) == 0
    held = {r["setting"]: r["held_bytes"] for r in json.loads(capsys.readouterr().out) if "seq" in r}
    assert list(held) == ["untiled+ckpt", "tiled+ckpt", "tiled+norms+ckpt"]
    assert held["tiled+norms+ckpt"] < held["tiled+ckpt"]
    with pytest.raises(SystemExit):
        main(argv + ["--tiled", "none", "--tiled-norms"])
    assert "--tiled-norms is planned beside the settings that tile the MLPs" in capsys.readouterr().err


def test_bench_norms_measures_a_lower_peak_and_the_same_step(capsys):
    """``tiled-mlp bench-norms`` on a tiny stack in bfloat16: the tiled norms' step holds less (HF's keeps
    float32 copies), computes the same within bfloat16's rounding, and the command prints its table."""
    from tiled_mlp.bench import norm_cost
    from tiled_mlp.cli.main import main

    cost = norm_cost.measure(layers=2, seq=512, hidden=32, intermediate=64, heads=2, rounds=1)
    assert cost.tiled_peak < cost.plain_peak and cost.difference < 2e-2
    assert main(["bench-norms", "--layers", "2", "--seq", "256", "--hidden", "32", "--intermediate", "64",
                 "--heads", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| tiled (norms=True) |" in out and "bfloat16, CPU" in out
    with pytest.raises(SystemExit):
        main(["bench-norms", "--hidden", "30", "--heads", "4"])
