"""A model under DDP, or under Ulysses SP (``apply_long_context(sequence_parallel=2)``), is freed by its last
reference (tests/test_freed_on_delete.py says why): two gloo ranks, the collector off on each."""
from __future__ import annotations

import pytest

from integration_tests.frameworks import need

from .freed_cases import freed_after_delete
from .spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def test_ddp_and_sequence_parallel_models_are_freed_by_their_last_reference(tmp_path):
    need("transformers")
    need("deepspeed")
    for rank, results in enumerate(run_distributed(freed_after_delete, 2, tmp_path, timeout=110)):
        alive = {case: held for case, held in results.items() if any(held.values())}
        assert not alive, f"rank {rank}: a reference cycle keeps these alive: {alive}"
