"""What the tiled call knows of a shard's collectives (``tiled_core/collectives.py``), on one process: which ops
are collectives, and the bounded wait for tensors a backend still holds. Their use under tensor parallelism, on
2 gloo ranks: ``integration_tests/test_tensor_parallel.py``."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tiled_mlp.core.collectives import is_collective, wait_released
from tiled_mlp.core.strict import strict_mode
from tiled_mlp.core.tensor_reads import TensorReads


@pytest.fixture(autouse=True)
def strict():
    """Kept tensors are looked for in strict mode (``tiled_core/strict.py``)."""
    with strict_mode():
        yield


def test_a_collective_is_known_by_its_operator_namespace():
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    assert is_collective(torch.ops._c10d_functional.all_reduce.default)
    assert is_collective(torch.ops._c10d_functional.all_reduce)  # the packet, as DTensor calls it
    assert is_collective(torch.ops._c10d_functional.wait_tensor.default)
    assert is_collective(torch.distributed.all_reduce) and is_collective(torch.distributed.all_gather)
    assert not is_collective(torch.ops.aten.add)
    assert not is_collective(torch.ops.aten.add.Tensor)
    assert not is_collective(torch.add)  # a torch function, not an operator of c10d's
    assert not is_collective(lambda t: t)


def test_the_wait_ends_when_another_thread_lets_go_and_gives_up_at_its_bound():
    held = [torch.ones(3)]
    memory = StorageWeakRef(held[0].untyped_storage())
    threading.Timer(0.05, held.clear).start()  # as gloo's worker thread drops its reference, a moment later
    start = time.monotonic()
    assert wait_released([memory], bound_s=5.0)
    assert time.monotonic() - start < 2.0

    kept = torch.ones(3)
    alias = kept.view(3, 1)  # what is watched is the memory: a view keeps it as the tensor does
    del kept
    start = time.monotonic()
    assert not wait_released([StorageWeakRef(alias.untyped_storage())], bound_s=0.1)
    assert 0.1 <= time.monotonic() - start < 1.0


def test_only_what_a_collective_took_or_made_counts_as_held_by_it():
    x = torch.ones(4)
    reads = TensorReads(known=[x], watch_kept=True)
    with reads:
        made = x * 2
    assert reads.kept() == [made]
    assert not reads.held_by_collective(made)
