"""Ulysses SP and the tiled loss over a sequence group (2 gloo processes): refusals no other test reaches, each
asserted by its key phrase, with what a refused call must leave unchanged (``refusals_sp_cases.py``)."""
from __future__ import annotations

import pytest

from .comparison import needs_deepspeed
from .refusals_sp_cases import LAZY_NAME, apply_refusals, call_refusals, lazily_registered_attention
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's

WORLD = 2


@pytest.mark.timeout(60)
def test_refusals_when_sp_is_applied_leave_nothing_behind(tmp_path):
    for out in run_distributed(apply_refusals, WORLD, tmp_path, timeout=50):
        assert out["groups_exist"][0] == "RuntimeError", out
        assert "DeepSpeed's SP groups already exist in this process" in out["groups_exist"][1], out
        assert out["groups_exist_unchanged"], out
        # DeepSpeed's own refusal, after it made its SP groups: released, the attention registry as it was.
        assert out["unregistered"][0] == "ValueError", out
        assert "no_such_attention is not a valid attn_implementation" in out["unregistered"][1], out
        assert out["unregistered_unchanged"], out
        assert out["not_a_group"] == ("TypeError", "tiled loss: sequence_group must be a torch.distributed "
                                                   "ProcessGroup, got list"), out
        assert out["not_a_group_untouched"], out
        assert out["rotary_layout"][0] == "RuntimeError", out
        assert "TransposedRotary returned [(1, 4, 9)], not [..., 9, dim] tensors for 9 positions" in out["rotary_layout"][1], out


@pytest.mark.timeout(60)
def test_refusals_of_a_call_under_sp(tmp_path):
    for out in run_distributed(call_refusals, WORLD, tmp_path, timeout=55):
        assert out["no_ids"][0] == "ValueError", out
        assert "the decoder was called without input_ids or inputs_embeds" in out["no_ids"][1], out
        assert out["different_masks"] == ("ValueError", "sequence parallelism: the SP ranks passed different "
                                                         "whole-sequence attention_masks"), out
        assert out["grads_untouched"], out
        assert out["engine_group"][0] == "UnsupportedBackendError", out
        assert "was built with the SP group of ranks [0, 1], but the loss is split across ranks" in out["engine_group"][1], out
        assert out["engine_group_untouched"], out


@pytest.mark.timeout(60)
def test_another_model_on_an_attention_name_registered_only_by_sp_is_refused(tmp_path):
    for kind, message in run_distributed(lazily_registered_attention, WORLD, tmp_path, timeout=50):
        assert kind == "RuntimeError", (kind, message)
        assert f"no attention function was registered under '{LAZY_NAME}' before SP" in message, message
