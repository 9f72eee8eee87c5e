"""Tiled RMSNorms under ``SequenceParallel`` (torchtitan's norms between the TP regions), 2 gloo processes,
float64, against one process running the whole untiled norm on the whole sequence (``tp_norm_cases.py``):
each rank tiles its own tokens through the strategy's sequence-parallel view and matches; a layout the view
cannot prove is refused with the reason."""
from __future__ import annotations

import pytest

from .spawn import run_distributed
from .tp_norm_cases import run_norm_cases, run_norm_on_2d_mesh

pytestmark = pytest.mark.distributed

WORLD = 2
BOUND = 1e-12


@pytest.mark.timeout(60)
def test_tiled_norms_under_sequence_parallel_match_one_process_on_the_whole_sequence(tmp_path):
    cases = [("torch", True), ("llama", True), ("torch", False)]
    for rank_results in run_distributed(run_norm_cases, WORLD, tmp_path, cases, timeout=50):
        for case in cases:
            result = rank_results[case]
            assert "raised" not in result, (case, result)
            bad = {what: error for what, error in result["errors"].items() if not error <= BOUND}
            assert not bad, (case, bad)
            assert result["path"] == "generic" and result["num_shards"] == 3, (case, result)


@pytest.mark.timeout(60)
def test_a_sequence_parallel_norm_weight_on_a_2d_mesh_is_refused(tmp_path):
    for message in run_distributed(run_norm_on_2d_mesh, WORLD, tmp_path, timeout=50):
        assert message.startswith("raised") and "not all on one 1-D mesh" in message, message
        assert "2-D mesh" in message and "SequenceParallel" in message, message
