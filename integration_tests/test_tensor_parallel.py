"""The tiled MLP under DTensor tensor parallelism (``parallelize_module``), 2 gloo processes, float64,
against one process running the whole untiled MLP (``tp_cases.py``): the gated fast kernel runs on each
rank's local weights through the strategy's local view and matches, on a replicated and on a
sequence-sharded (torchtitan) layout; what it cannot prove declines or is refused with the reason."""
from __future__ import annotations

import pytest

from .spawn import run_distributed
from .tp_cases import HIDDEN, INTERMEDIATE, run_tp_cases, run_tp_refusals

pytestmark = pytest.mark.distributed

WORLD = 2
BOUND = 1e-12


def _exact(result: dict, case) -> None:
    assert "raised" not in result, (case, result)
    bad = {what: error for what, error in result["errors"].items() if not error <= BOUND}
    assert not bad, (case, bad)


@pytest.mark.timeout(60)
def test_fast_kernel_on_local_weights_matches_one_process_under_tensor_parallelism(tmp_path):
    cases = [("replicate", "fast"), ("sequence_input", "fast"), ("sequence", "fast"), ("replicate", "auto")]
    for rank_results in run_distributed(run_tp_cases, WORLD, tmp_path, cases, timeout=50):
        for case in cases:
            result = rank_results[case]
            _exact(result, case)
            assert result["path"] == "fast" and result["num_shards"] == 3, (case, result)
            assert "kernel 'fast'" in result["reason"], (case, result["reason"])
            # The auto policy sizes shards from the rank's local weights: its slice of the intermediate dim.
            local_weights = 3 * HIDDEN * INTERMEDIATE // WORLD
            assert (result["intermediate"], result["param_bytes"]) == (INTERMEDIATE // WORLD, 8 * local_weights), result


@pytest.mark.timeout(60)
def test_what_the_local_view_cannot_prove_declines_and_the_generic_kernel_refuses_tp_modules(tmp_path):
    # The tiled norm under SequenceParallel computes (its exactness: test_tensor_parallel_norms.py).
    cases = [("down_bias", "auto"), ("dtensor_activations", "auto"), ("sequence", "generic"), ("replicate", "generic")]
    for rank_results in run_distributed(run_tp_refusals, WORLD, tmp_path, cases, timeout=50):
        bias, activations, sequence, replicate = (rank_results[case]["raised"] for case in cases)
        norm = rank_results["norm"]
        assert norm == "returned (2, 6, 8) through generic", norm
        assert "down_proj has a bias" in bias and "the generic kernel would run its collectives" in bias
        assert "gate_proj's output is (Shard(dim=-1),) (use_local_output=False)" in activations
        assert "over a token dimension" in sequence and "down_proj's output hook (RowwiseParallel)" in sequence
        assert "the generic kernel would run its collectives once per token shard" in replicate
