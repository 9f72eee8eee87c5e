"""Collectives inside a shard (``tiled_core/collectives.py``), on 2 gloo processes: both kinds a tensor-parallel
layer calls are seen by what they are, with the memory they took or made; and a collective on memory from before
the call (a buffer, the call's input) is no tensor the shard kept."""
from __future__ import annotations

import pytest

from .collective_cases import collectives_seen, in_strict_mode, kept_input_view, long_lived_memory_runs
from .spawn import run_distributed

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(60)
def test_torch_distributed_and_functional_collectives_are_both_seen(tmp_path):
    for seen in run_distributed(in_strict_mode, 2, tmp_path, collectives_seen, timeout=50):
        assert seen["in_place"] and seen["packet"] and seen["functional"] and not seen["plain"], seen
        # Alive: the in-place one's memory (its input is its result) and both functional results; none once those
        # are the expected ones (the functional inputs are dead by then).
        assert seen["memory_alive"] >= 3 and seen["memory_expected"] == 0, seen


@pytest.mark.timeout(60)
def test_a_collective_on_a_buffer_or_the_input_is_no_kept_tensor(tmp_path):
    for errors in run_distributed(long_lived_memory_runs, 2, tmp_path, timeout=50):
        assert errors.pop("broadcast_buffer_path") == 1.0 and errors.pop("gather_input_path") == 1.0, errors
        assert all(error <= 1e-12 for error in errors.values()), errors


@pytest.mark.timeout(60)
def test_a_kept_view_of_the_input_a_collective_took_is_refused_on_every_rank(tmp_path):
    for outcome in run_distributed(in_strict_mode, 2, tmp_path, kept_input_view, timeout=50):
        assert outcome.startswith("raised: ") and "were kept after their shard" in outcome, outcome
        assert "a collective took" in outcome, outcome
