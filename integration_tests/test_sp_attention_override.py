"""Ulysses SP keeps a user's own attention function registered under the model's attention name: the SP
model runs it on the whole sequence after DeepSpeed's all-to-all, another model in the process runs it
without SP, and ``remove()`` leaves it in place; packed samples without a cache, which HF would mask apart
for it and DeepSpeed does not, are refused (2 gloo processes)."""
from __future__ import annotations

import pytest

from .comparison import needs_deepspeed
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's


@pytest.mark.timeout(60)
def test_sp2_runs_a_users_attention_override_for_its_model_and_others(tmp_path):
    from .sp_override_cases import user_override_kept

    for rank, out in enumerate(run_distributed(user_override_kept, 2, tmp_path, timeout=50)):
        tokens = out["tokens"]
        # 2 layers, forward only (no checkpointing): each attention module calls it once, on all tokens
        assert out["sp"] == [(True, tokens)] * 2, (rank, out["sp"])
        assert out["other"] == [(True, tokens)] * 2, (rank, out["other"])
        assert out["kept_after_remove"], rank
        kind, message = out["packed"]
        assert kind == "RuntimeError" and "packed samples (position_ids restarting) without a cache" in message, \
            (rank, out["packed"])
