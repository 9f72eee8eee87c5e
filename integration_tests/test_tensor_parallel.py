"""The tiled MLP under DTensor tensor parallelism (``parallelize_module``), 2 gloo processes, float64,
against one process running the whole untiled MLP (``tp_cases.py``): the gated fast kernel runs on each
rank's local weights through the strategy's local view and matches, on a replicated and on a
sequence-sharded (torchtitan) layout; where it declines, the generic kernel runs the module's own forward,
collectives included, once per shard and matches too; what neither can prove is refused with the reason."""
from __future__ import annotations

import pytest

from .collective_cases import in_strict_mode
from .spawn import run_distributed
from .tp_cases import HIDDEN, INTERMEDIATE, run_tp_cases, run_tp_refusals, run_uneven_auto

pytestmark = pytest.mark.distributed

WORLD = 2
BOUND = 1e-12


def _assert_exact_case(result: dict, case) -> None:
    assert "raised" not in result, (case, result)
    bad = {what: error for what, error in result["errors"].items() if not error <= BOUND}
    assert not bad, (case, bad)


@pytest.mark.timeout(60)
def test_fast_kernel_on_local_weights_matches_one_process_under_tensor_parallelism(tmp_path):
    cases = [("replicate", "fast"), ("sequence_input", "fast"), ("sequence", "fast"), ("replicate", "auto")]
    for rank_results in run_distributed(run_tp_cases, WORLD, tmp_path, cases, timeout=50):
        for case in cases:
            result = rank_results[case]
            _assert_exact_case(result, case)
            assert result["path"] == "fast" and result["num_shards"] == 3, (case, result)
            assert "kernel 'fast'" in result["reason"], (case, result["reason"])
            # The auto policy sizes shards from the rank's local weights: its slice of the intermediate dim.
            local_weights = 3 * HIDDEN * INTERMEDIATE // WORLD
            assert (result["intermediate"], result["param_bytes"]) == (INTERMEDIATE // WORLD, 8 * local_weights), result
            assert result["pending_works"] == 0, result


@pytest.mark.timeout(60)
def test_generic_kernel_runs_tensor_parallel_collectives_per_shard_and_matches_one_process(tmp_path):
    # Each forward shard all-reduces its partial sum (RowwiseParallel's output hook) and so does each shard's
    # recompute: gloo still holds a reduced tensor for a moment after some of those waits, which the check that no
    # shard's tensor outlives its shard must wait out on every rank alike (a rank refusing alone deadlocks the
    # other), and the recompute's all-reduces must be waited for (else c10d's registry keeps each one's work).
    cases = [("replicate", "generic"), ("sequence_input", "generic"), ("down_bias", "auto"), ("dtensor_activations", "auto"),
             ("gelu", "auto"), ("gelu_hidden_input", "auto")]
    for rank_results in run_distributed(run_tp_cases, WORLD, tmp_path, cases, timeout=50):
        for case in cases:
            result = rank_results[case]
            _assert_exact_case(result, case)
            assert result["path"] == "generic" and result["num_shards"] == 3, (case, result)
            assert result["pending_works"] == 0, (case, result)
        # Why the fast kernel declined, where it was asked.
        assert "down_proj has a bias" in rank_results["down_bias", "auto"]["reason"]
        assert "gate_proj's output is (Shard(dim=-1),) (use_local_output=False)" in rank_results[
            "dtensor_activations", "auto"]["reason"]


@pytest.mark.timeout(60)
def test_auto_shard_count_is_the_same_on_ranks_holding_uneven_slices(tmp_path):
    # The generic kernel all-reduces once per shard: ranks that chose different counts would fail or hang.
    for result in run_distributed(run_uneven_auto, WORLD, tmp_path, timeout=50):
        _assert_exact_case(result, "uneven")
        assert result["path"] == "generic" and result["num_shards"] == 4, result
        assert result["pending_works"] == 0, result


@pytest.mark.timeout(60)
def test_what_no_kernel_proves_under_tensor_parallelism_is_refused_on_every_rank(tmp_path):
    # The tiled norm under SequenceParallel computes (its exactness: test_tensor_parallel_norms.py). A hook that
    # keeps each shard's all-reduced output is refused on both ranks, with no rank left in the next collective.
    cases = [("sequence", "generic"), ("sequence_negative", "generic"), ("gelu_stashed", "auto"),
             ("gelu_dtensor_output", "auto")]
    # Strict mode: a hook's kept tensors are looked for there (``tiled_core/strict.py``).
    for rank_results in run_distributed(in_strict_mode, WORLD, tmp_path, run_tp_refusals, cases, timeout=50):
        sequence, negative, stashed, dtensor_output = (rank_results[case]["raised"] for case in cases)
        assert "returned a DTensor" in dtensor_output and "use_local_output=True" in dtensor_output, dtensor_output
        norm = rank_results["norm"]
        assert norm == "returned (2, 6, 8) through generic", norm
        for refusal in (sequence, negative):  # Shard(1) and Shard(-2) name the same token dim
            assert "over a token dimension" in refusal and "down_proj's output hook (RowwiseParallel)" in refusal
        assert "were kept after their shard" in stashed and "_ToTorchTensorBackward" in stashed, stashed
