"""How gradients are reduced over the SP ranks is read from a live DeepSpeed engine only: after
``engine.destroy()`` the model (trained on under SP by another backend) averages, and a live engine on a
model FSDP2 also shards is refused (2 gloo processes)."""
from __future__ import annotations

import pytest

from .comparison import needs_deepspeed
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's


@pytest.mark.timeout(60)
def test_a_destroyed_deepspeed_engine_no_longer_decides_the_sp_gradient_factor(tmp_path):
    from .sp_engine_cases import destroyed_engine_runs

    for rank, out in enumerate(run_distributed(destroyed_engine_runs, 2, tmp_path, timeout=50)):
        assert out["live_sums"] is True, (rank, out)
        kind, message = out["live_beside_fsdp2"]["error"]
        assert kind == "UnsupportedBackendError" and "FSDP2 (fully_shard) trains it too" in message, (rank, message)
        assert out["engines_after_destroy"] == 0 and out["sums_after_destroy"] is False, (rank, out)
