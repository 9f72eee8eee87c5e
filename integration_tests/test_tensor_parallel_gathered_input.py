"""Tensor-parallel layouts the fast kernel's local view must compute exactly or refuse (2 gloo processes,
float64, against one process: ``tp_gathered_input_cases.py``)."""
from __future__ import annotations

import pytest

from .spawn import run_distributed
from .tp_gathered_input_cases import run_review_case

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(60)
def test_colwise_gate_and_up_gathering_a_sequence_sharded_input_are_refused(tmp_path):
    # ColwiseParallel(input_layouts=Shard(1)) on gate and up: the MLP gets each rank's slice of the
    # sequence as a plain tensor, which the view's ``enter`` gathers to the whole sequence, while the
    # call's shards are planned on the local tokens (measured without the refusal: output off by 0.8).
    for result in run_distributed(run_review_case, 2, tmp_path, "colwise_sequence_input", 3, timeout=50):
        assert "raised" in result, result
        assert "gate_proj's input hook reads a plain input as (Shard(dim=1),)" in result["raised"], result
