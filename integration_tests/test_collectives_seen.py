"""What the tiled call's watch of a shard records of collectives (``tiled_core/collectives.py``), on 2 gloo
processes: both kinds a tensor-parallel layer calls, by what they are, and the memory they took or made."""
from __future__ import annotations

import pytest

from .spawn import run_distributed
from .tp_cases import collectives_seen

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(60)
def test_torch_distributed_and_functional_collectives_are_both_seen(tmp_path):
    for seen in run_distributed(collectives_seen, 2, tmp_path, timeout=50):
        assert seen["in_place"] and seen["functional"] and not seen["plain"], seen
        # The in-place one's memory (its input is its result), and the functional one's input and result;
        # none left once the caller's results are the expected ones, but the functional input (dead by now).
        assert seen["memory_alive"] >= 2 and seen["memory_expected"] == 0, seen
