"""``tiled_cross_entropy`` on a vocabulary-parallel ``lm_head`` (tensor parallelism, two gloo processes):
``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``, each rank holding its rows of the
weight (51 rows: 26 and 25), against the same loss on the whole head in one process, float64.

Per option (none, label smoothing, soft-capping, z-loss, ``num_items_in_batch``, an ``ignore_index`` with
ignored tokens, the sum, a bias, all of them at once, one shard, the auto shard count, a sequence-parallel
input ``Shard(1)``): the loss, dx, the head's full weight (and bias) gradient and the gradient of the
replicated projection that feeds the head (which sees dx only after autograd's all-reduce), on both ranks,
within ``BOUND``. Then two SGD steps with every option. Then the layouts it refuses, before any work,
naming the layout and the fix.
"""
from __future__ import annotations

import pytest

from .comparison import BOUND
from .spawn import run_distributed
from .tp_loss_cases import CASES, option_cases, sgd_steps, tp_loss_refusals

pytestmark = pytest.mark.distributed

WORLD = 2


@pytest.fixture(scope="module")
def option_errors(tmp_path_factory):
    """One distributed run for every option case: ``{case: {tensor: error}}`` per rank."""
    return run_distributed(option_cases, WORLD, tmp_path_factory.mktemp("tp-loss"), list(CASES), timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_vocab_parallel_loss_matches_the_whole_head(option_errors, case):
    for rank, errors in enumerate(option_errors):
        bad = {name: error for name, error in errors[case].items() if not error <= BOUND}
        assert not bad, f"rank {rank}, {case}: relative errors above {BOUND}: {bad}"
        assert {"loss", "dx", "d_lm_head.weight", "d_proj.weight"} <= set(errors[case])


@pytest.mark.timeout(180)
def test_vocab_parallel_loss_trains_as_the_whole_head(tmp_path):
    per_rank = run_distributed(sgd_steps, WORLD, tmp_path, 2, timeout=120)
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 2
        for step, errors in enumerate(steps):
            bad = {name: error for name, error in errors.items() if not error <= BOUND}
            assert not bad, f"rank {rank}, step {step}: relative errors above {BOUND}: {bad}"
            assert "param_lm_head.bias" in errors


@pytest.mark.timeout(180)
def test_unsupported_tensor_parallel_heads_are_refused_by_layout(tmp_path):
    for messages in run_distributed(tp_loss_refusals, WORLD, tmp_path, timeout=120):
        hidden = messages["sharded_on_hidden"]
        assert hidden is not None and "RowwiseParallel" in hidden and "Shard(1)" in hidden, hidden
        assert "ColwiseParallel" in hidden
        replicated = messages["replicated_by_style"]
        assert replicated is not None and "SequenceParallel" in replicated and "Replicate()" in replicated, replicated
        bare = messages["dtensor_without_style"]
        assert bare is not None and "Replicate()" in bare and "ColwiseParallel" in bare, bare
        for message in messages.values():
            assert "FSDP2 outside" not in (message or "")
