"""Refusals of the tiled loss on a Hugging Face causal LM (``causal_lm_loss.py``) that no other test reaches: its
forward called through a shallow copy after the model it was installed on was deleted, and a decoder replaced
after installing (the hook that hands the loss its hidden states is on the old one)."""
from __future__ import annotations

import copy
import gc

import pytest

pytest.importorskip("transformers")

from integration_tests.tiny_models import tiny_model, token_batch  # noqa: E402
from tiled_mlp import apply_tiled_loss  # noqa: E402


def test_the_forward_of_a_deleted_model_called_through_a_shallow_copy_is_refused():
    model = tiny_model("llama")
    apply_tiled_loss(model)
    forward = copy.copy(model).forward  # copy.copy shares the instance's forward, the tiled loss's
    del model
    gc.collect()
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match="the model this forward was installed on was deleted, and the forward "
                                           "was called without going through a model"):
        forward(input_ids=ids, labels=labels)


def test_a_decoder_replaced_after_installing_is_refused_at_the_call():
    from transformers import LlamaModel

    model = tiny_model("llama")
    apply_tiled_loss(model)
    model.model = LlamaModel(model.config).double()
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match="forward did not call the decoder the tiled loss was installed on"):
        model(input_ids=ids, labels=labels)
    assert all(p.grad is None for p in model.parameters())
