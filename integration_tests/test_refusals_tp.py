"""Tensor-parallel layouts the library refuses (2 gloo processes): each error's key phrase, raised before any work
(``refusals_tp_cases.py``)."""
from __future__ import annotations

import pytest

from .frameworks import need
from .hf_tp_cases import save_tiny_llama
from .refusals_tp_cases import (
    UNPROVEN,
    fast_view_declines,
    head_refusals,
    hf_head_refusals,
    hf_unproven_layouts,
    norm_refusals,
    sequence_view_declines,
)
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.mark.timeout(60)
def test_a_sequence_parallel_norm_refuses_an_input_it_cannot_compute_on(tmp_path):
    for out in run_distributed(norm_refusals, WORLD, tmp_path, timeout=50):
        assert out["other_mesh"].startswith("raised: tensor parallelism: the tiled call's input is a DTensor"), out
        assert "on the weight's mesh that SequenceParallel's input hook makes" in out["other_mesh"], out
        assert "SequenceParallel shards the hidden dimension of the input (sequence_dim=2)" in out["hidden_sharded"], out
        assert "SequenceParallel shards the hidden dimension of the input (sequence_dim=-1)" in \
            out["hidden_sharded_as_last"], out
        assert out["tokens_as_negative"].startswith("returned"), out


@pytest.mark.timeout(60)
def test_the_vocabulary_parallel_loss_refuses_heads_whose_rows_it_cannot_place(tmp_path):
    for out in run_distributed(head_refusals, WORLD, tmp_path, timeout=50):
        kind, message = out["replicated_bias"]
        assert kind == "UnsupportedBackendError" and "with its bias a DTensor (Replicate(),)" in message, out
        assert "Parallelize lm_head with ColwiseParallel" in message, out
        kind, message = out["uneven_rows"]
        assert kind == "UnsupportedBackendError" and "the vocabulary offset of this rank is unknown" in message, out
        kind, message = out["sequence_group"]
        assert kind == "UnsupportedBackendError" and "is vocabulary-parallel (ColwiseParallel) and a sequence_group " \
            "was given" in message, out
        kind, message = out["resharded_by_fsdp2"]
        assert kind == "UnsupportedBackendError" and "keep lm_head out of fully_shard" in message, out


@pytest.mark.timeout(60)
def test_the_tiled_loss_alone_refuses_hugging_face_heads_it_does_not_prove(tmp_path):
    transformers = need("transformers")
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    for out in run_distributed(hf_head_refusals, WORLD, tmp_path, path, timeout=50):
        kind, message = out["unchecked_version"]
        assert kind == "UnsupportedBackendError", out
        assert f"laid out Linear under transformers {transformers.__version__};" in message, out
        assert "on transformers 0.0.0 only" in message, out
        kind, message = out["unproven_style"]
        assert kind == "UnsupportedBackendError", out
        assert "tiled loss: Linear is tensor-parallel with Hugging Face's SubclassedColwise (weight a DTensor" in message, out
        assert "Lay lm_head out with Hugging Face's 'colwise' or 'colwise_gather_output' style" in message, out


@pytest.mark.timeout(60)
def test_hugging_face_styles_the_seam_does_not_prove_are_refused_at_the_first_forward(tmp_path):
    need("transformers")
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    for out in run_distributed(hf_unproven_layouts, WORLD, tmp_path, path, timeout=55):
        assert set(out) == set(UNPROVEN), out
        for how, (expected, (kind, message)) in out.items():
            assert expected.startswith("refused at the first forward"), (how, expected)
            assert kind == "RuntimeError" and "no registered kernel runs TiledLlamaMLP" in message, (how, message)
            assert "gate_proj (Hugging Face's ColwiseParallel)" in message, (how, message)


# The reason the fast kernel's local view gives for each layout it does not prove (``path="fast"`` raises it).
FAST_DECLINES = {
    "fused": "a fused gate_up_proj is not split into gate and up alike by ColwiseParallel",
    "down_plain": "some projections' parameters are DTensors and others are not",
    "two_meshes": "the projections' parameters are not all on one 1-D mesh",
    "replicated_weight": "gate_proj.weight is (Replicate(),), not (S(0),)",
    "rowwise_gate": "gate_proj is laid out by RowwiseParallel, not the colwise style the fast kernel computes",
    "inputs_differ": "gate_proj and up_proj prepare their input differently",
    "input_not_replicated": "gate_proj's input is made (Shard(dim=-1),), not Replicate",
    "down_input": "down_proj's input is prepared as ((Replicate(),), (Shard(dim=-1),)), not Shard(-1) kept as it is",
}


# The reason the sequence-parallel view gives for each norm layout it does not prove.
SEQUENCE_DECLINES = {
    "submodule": "TiledRMSNorm has submodules; the view proves a module with none",
    "extra_hook": "TiledRMSNorm has 1 forward pre-hooks and 2 forward hooks, not SequenceParallel's own",
    "frozen": "TiledRMSNorm has a frozen parameter",
    "plain_parameter": "some parameters are DTensors and others are not",
    "sharded_weight": "a parameter is a DTensor (Shard(dim=0),) over a 1-D mesh (2,), not Replicate",
    "weight_on_other_mesh": "its hooks are on another mesh than its parameters",
    "replicated_input": "its input is laid out as (Replicate(),), not one Shard",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, declines, raised_as, reason_as", [
    (fast_view_declines, FAST_DECLINES, "raised: path='fast' cannot apply to ", "tensor parallelism: {}"),
    (sequence_view_declines, SEQUENCE_DECLINES, "raised: TiledMLP: no registered kernel runs TiledRMSNorm",
     "'generic' declined: tensor parallelism (SequenceParallel): {}"),
], ids=["fast_kernel", "sequence_parallel_norm"])
def test_layouts_a_local_view_does_not_prove_are_refused(tmp_path, body, declines, raised_as, reason_as):
    for out in run_distributed(body, WORLD, tmp_path, timeout=50):
        assert set(out) == set(declines), out
        for case, words in declines.items():
            assert out[case].startswith(raised_as), (case, out[case])
            assert reason_as.format(words) in out[case], (case, out[case])
