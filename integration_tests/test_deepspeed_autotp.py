"""DeepSpeed AutoTP (training tensor parallelism) on 2 gloo processes, float32 (an AutoTP engine cannot reduce
float64 gradients): a model whose MLPs and loss are tiled trains as the same engine untiled does, the generic
kernel running each block's own forward and ``LinearAllreduce``'s all-reduce once per shard, the loss's module
kernel AutoTP's gathering ``lm_head`` once per shard, and a row-parallel layer as a head likewise; an AutoTP layer
whose output stays split, given as the loss's head, is refused on every rank alike, before any work
(``strategies/deepspeed_autotp.py``)."""
from __future__ import annotations

import pytest

from .autotp_cases import tiled_blocks_under_autotp
from .spawn import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

# float32 against float32: the tiled forward and backward sum the same products in another order (per shard).
# Measured: the losses within 1.2e-7 relative, every gradient within 4.8e-7 of its largest entry.
BOUND = 2e-6


@pytest.mark.timeout(120)
def test_tiled_mlps_and_loss_train_under_autotp_as_untiled_and_a_split_head_is_refused(tmp_path):
    ranks = run_distributed(tiled_blocks_under_autotp, 2, tmp_path, timeout=110)
    for rank in ranks:
        # Not vacuous: AutoTP did replace the MLP's Linears and the head, and the tiled loss ran on the head.
        assert rank["mlp_layers"] == {"gate_proj": "LinearLayer", "up_proj": "LinearLayer",
                                      "down_proj": "LinearAllreduce", "act_fn": "SiLUActivation"}, rank["mlp_layers"]
        assert rank["head_layer"] == "LinearLayer"
        assert rank["mlp_last_path"] == "generic" and rank["mlp_num_shards"] == 3, rank
        assert rank["loss_kernels"] == ["ModuleHeadKernel"] * 2, rank["loss_kernels"]
        assert rank["grads_compared"], rank
        assert all(e <= BOUND for e in rank["loss_errors"] + rank["grad_errors"]), rank
        kind, message = rank["split_head"]
        assert kind == "UnsupportedBackendError", rank["split_head"]
        assert "AutoTP's LinearLayer" in message and "its output stays split over the ranks" in message, message
        assert all(e <= BOUND for e in rank["row_head_errors"]), rank["row_head_errors"]
