"""Tensor-parallel layouts the library refuses (2 gloo processes): each error's key phrase, raised before any work
(``refusals_tp_cases.py``)."""
from __future__ import annotations

import pytest

from .frameworks import need
from .hf_tp_cases import save_tiny_llama
from .refusals_tp_cases import head_refusals, hf_head_unchecked_version, norm_refusals
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.mark.timeout(60)
def test_a_sequence_parallel_norm_refuses_an_input_it_cannot_compute_on(tmp_path):
    for out in run_distributed(norm_refusals, WORLD, tmp_path, timeout=50):
        assert out["other_mesh"].startswith("raised: tensor parallelism: the tiled call's input is a DTensor"), out
        assert "on the weight's mesh that SequenceParallel's input hook makes" in out["other_mesh"], out
        assert "SequenceParallel shards the hidden dimension of the input (sequence_dim=2)" in out["hidden_sharded"], out


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


@pytest.mark.timeout(60)
def test_the_tiled_loss_alone_refuses_a_hugging_face_head_from_an_unchecked_version(tmp_path):
    transformers = need("transformers")
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    for kind, message in run_distributed(hf_head_unchecked_version, WORLD, tmp_path, path, timeout=50):
        assert kind == "UnsupportedBackendError", (kind, message)
        assert f"laid out Linear under transformers {transformers.__version__};" in message, message
        assert "on transformers 0.0.0 only" in message, message
