"""TiledMLP under DDP: two gloo processes on CPU.

Every rank's gradients must be bitwise equal to the other rank's and equal (float64, 1e-10 relative)
to a single-process *untiled* reference on the global batch; DDP averages over ranks, and each rank's
loss is a mean over its own equal-sized micro-batch, so the reference loss is the mean over ranks.
All cases share one spawned run (process start-up is the expensive part).
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torch import nn

from tiled_mlp import TiledMLP

from .spawn import run_distributed
from .toy_models import make_toy_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

WORLD = 2
HIDDEN = 16
BATCH_PER_RANK, TOKENS = 2, 7
TOL = 1e-10


def undistributed_name(name: str) -> str:
    """Parameter names of the untiled model: no DDP ``module.`` prefix (tiling adds nothing)."""
    return name.removeprefix("module.")


def ddp_batch(seed: int, rank: int, tokens: int = TOKENS):
    """The micro-batch of ``rank`` in the global batch made from ``seed`` (inputs and targets)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(WORLD * BATCH_PER_RANK, tokens, HIDDEN, generator=generator, dtype=torch.float64)
    target = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[rows], target[rows]


def ddp_loss(model: nn.Module, data) -> torch.Tensor:
    x, target = data
    return (model(x) - target).pow(2).mean()


def grads_of(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {undistributed_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def float64_toy_model(**kwargs) -> nn.Module:
    # make_toy_model(dtype=...) casts before adding LoRA, whose adapters then stay float32: cast after.
    return make_toy_model(seed=0, **kwargs).double()


# -- what the ranks run ---------------------------------------------------------------------------
CASES = {
    "fast": dict(path="fast"),
    "generic": dict(path="generic"),
    "lora": dict(path="auto", lora=True),
}


def _tiled_ddp(rank: int, num_shards, path: str, lora: bool = False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = float64_toy_model(tiled=True, lora=lora, num_shards=num_shards, path=path)
    return model, DDP(model)


def _tiled_facts(model) -> dict:
    tiled = [layer.mlp for layer in model.layers]
    return {"paths": [t.tiling.last_path for t in tiled], "shards": [t.tiling.last_num_shards for t in tiled],
            "strategies": [t.tiling.last_strategy.name for t in tiled]}


def ddp_ranks_main(rank: int, world_size: int) -> dict:
    out = {}
    for name, case in CASES.items():
        model, ddp = _tiled_ddp(rank, 3, case["path"], case.get("lora", False))
        ddp_loss(ddp, ddp_batch(1, rank)).backward()
        out[name] = {"grads": grads_of(ddp), **_tiled_facts(model)}

    # no_sync: a local backward on rank-specific data, then a synced one.
    model, ddp = _tiled_ddp(rank, 3, "auto")
    with ddp.no_sync():
        ddp_loss(ddp, ddp_batch(2, rank)).backward()
    local = grads_of(ddp)
    ddp_loss(ddp, ddp_batch(3, rank)).backward()
    out["no_sync"] = {"local": local, "synced": grads_of(ddp)}

    # Rank-dependent token and shard counts: no collective per shard, so no deadlock.
    model, ddp = _tiled_ddp(rank, 2 + 3 * rank, "auto")
    ddp_loss(ddp, ddp_batch(4, rank, tokens=TOKENS + 4 * rank)).backward()
    out["uneven"] = {"grads": grads_of(ddp), **_tiled_facts(model)}

    out["unused"] = _unused_parameter_steps(rank)
    return out


def _with_unused_parameters(model: nn.Module) -> nn.Module:
    for layer in model.layers:
        layer.mlp.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))  # never read by forward
    return model


def _unused_parameter_steps(rank: int) -> dict:
    """DDP(find_unused_parameters=True) around MLPs that own a parameter their forward never reads.

    The tiled Function takes it as an input, so DDP finds it reachable and waits for its gradient: the
    ddp strategy delivers zeros. With None (the single-device answer) the reducer would never finish
    and the second step would raise "Expected to have finished reduction in the prior iteration"."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _with_unused_parameters(float64_toy_model(tiled=False))
    for layer in model.layers:
        TiledMLP(layer.mlp, num_shards=3)
    ddp = DDP(model, find_unused_parameters=True)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ddp_loss(ddp, ddp_batch(5 + step, rank)).backward()
    return {"grads": grads_of(ddp), **_tiled_facts(model),
            "unused": [layer.mlp.unused.grad for layer in model.layers]}


# -- the single-process reference -----------------------------------------------------------------
def ddp_reference_grads(batches: List, lora: bool = False) -> Dict[str, torch.Tensor]:
    """Untiled float64 gradients of ``sum(losses) / len(batches)`` (DDP's average over ranks)."""
    model = float64_toy_model(tiled=False, lora=lora)
    loss = sum(ddp_loss(model, data) for data in batches) / len(batches)
    loss.backward()
    return grads_of(model)


def assert_grads_close(want: Dict[str, torch.Tensor], have: Dict[str, torch.Tensor], context: str) -> None:
    assert want.keys() == have.keys(), f"{context}: trained parameters differ"
    errors = {n: float((have[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)) for n, w in want.items()}
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"{context}: relative gradient errors above {TOL:g}: {bad}"


def assert_ranks_equal(results: List[Dict[str, torch.Tensor]], context: str) -> None:
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        different = [n for n in first if not torch.equal(first[n], other[n])]
        assert not different, f"{context}: rank {rank} differs from rank 0 in {different}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(ddp_ranks_main, WORLD, tmp_path_factory.mktemp("ddp"), timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_grads_equal_on_every_rank_and_to_the_untiled_reference(ranks, case):
    results = [r[case] for r in ranks]
    assert all(r["strategies"] == ["ddp"] * 2 for r in results)
    assert all(r["shards"] == [3, 3] for r in results)
    expected_paths = {"fast": ["fast", "fast"]}.get(case, ["generic", "generic"])
    assert all(r["paths"] == expected_paths for r in results)
    grads = [r["grads"] for r in results]
    assert_ranks_equal(grads, case)
    want = ddp_reference_grads([ddp_batch(1, rank) for rank in range(WORLD)], lora=CASES[case].get("lora", False))
    assert_grads_close(want, grads[0], case)


def test_an_unused_parameter_under_ddp_with_find_unused_parameters_completes(ranks):
    results = [r["unused"] for r in ranks]
    assert all(r["strategies"] == ["ddp"] * 2 and r["paths"] == ["generic"] * 2 for r in results)
    assert all(all(g is not None and not g.any() for g in r["unused"]) for r in results)  # zeros, delivered
    grads = [{n: g for n, g in r["grads"].items() if not n.endswith(".unused")} for r in results]
    assert_ranks_equal(grads, "unused")
    model = _with_unused_parameters(float64_toy_model(tiled=False))
    (sum(ddp_loss(model, ddp_batch(6, rank)) for rank in range(WORLD)) / WORLD).backward()
    want = grads_of(model)
    assert all(layer.mlp.unused.grad is None for layer in model.layers)  # untiled: None
    assert_grads_close(want, grads[0], "unused")


def test_no_sync_leaves_grads_local_then_a_synced_backward_averages_the_accumulated_grads(ranks):
    local = [r["no_sync"]["local"] for r in ranks]
    for rank in range(WORLD):
        assert_grads_close(ddp_reference_grads([ddp_batch(2, rank)]), local[rank], f"no_sync rank {rank}")
    assert any(not torch.equal(local[0][n], local[1][n]) for n in local[0]), "no_sync grads were synchronised"

    synced = [r["no_sync"]["synced"] for r in ranks]
    assert_ranks_equal(synced, "after the synced backward")
    # Mean over ranks of each rank's accumulated (micro-batch 2 + micro-batch 3) gradient.
    want = ddp_reference_grads([data for rank in range(WORLD) for data in (ddp_batch(2, rank), ddp_batch(3, rank))])
    want = {n: 2 * g for n, g in want.items()}  # reference_grads divides by 4 batches, DDP by 2 ranks
    assert_grads_close(want, synced[0], "synced after no_sync")


def test_rank_dependent_shard_counts_finish_and_are_right(ranks):
    results = [r["uneven"] for r in ranks]
    assert [r["shards"] for r in results] == [[2, 2], [5, 5]]
    grads = [r["grads"] for r in results]
    assert_ranks_equal(grads, "uneven")
    want = ddp_reference_grads([ddp_batch(4, rank, tokens=TOKENS + 4 * rank) for rank in range(WORLD)])
    assert_grads_close(want, grads[0], "uneven")
