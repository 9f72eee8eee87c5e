"""DeepSpeed AutoTP (training tensor parallelism) on 2 gloo processes: tiled MLP blocks and the tiled loss
are refused, on every rank alike, before any work (``strategies/deepspeed_autotp.py`` says why)."""
from __future__ import annotations

import pytest

from .autotp_cases import tiled_blocks_under_autotp
from .spawn import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def test_autotp_mlp_and_head_are_refused_before_any_work(tmp_path):
    ranks = run_distributed(tiled_blocks_under_autotp, 2, tmp_path, timeout=90)
    for rank in ranks:
        # Not vacuous: AutoTP did replace the MLP's Linears and the head.
        assert rank["mlp_layers"] == {"gate_proj": "LinearLayer", "up_proj": "LinearLayer",
                                      "down_proj": "LinearAllreduce", "act_fn": "SiLUActivation"}, rank["mlp_layers"]
        assert rank["head_layer"] == "LinearLayer"
        kind, message = rank["mlp"]
        assert kind == "UnsupportedBackendError", rank["mlp"]
        assert "DeepSpeed AutoTP" in message and "down_proj (LinearAllreduce)" in message, message
        assert "exclude=" in message
        assert rank["mlp_last_path"] is None  # refused before the shard loop
        kind, message = rank["loss"]
        assert kind == "UnsupportedBackendError", rank["loss"]
        assert "AutoTP's LinearLayer" in message and "(32, 16)" in message, message
