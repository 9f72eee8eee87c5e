"""A per-shard kernel the package does not ship, added through ``register_kernel`` alone, runs a tiled toy MLP
under DDP in two gloo processes: ``toy_kernel.TanhMLPKernel`` (a registry entry of its own), and
docs/architecture.md's kernel example, run verbatim on each rank.

On each rank the outputs, the input gradients and every parameter gradient must equal (float64) a
single-process untiled reference on the global batch; ``tiling.last_path`` names the kernel. Ranks see
different token counts, so different shard counts.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch

from tiled_mlp import TiledMLP, register_kernel

from .spawn import run_distributed
from .toy_kernel import DOCS_KERNEL_NAME, NAME, TanhMLP, TanhMLPKernel, run_docs_kernel_example
from .toy_models import regression_batch, residual_stack

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD = 2
HIDDEN, INTER = 8, 20
TOKENS = (11, 23)  # per rank
TOL = 1e-12


def _kernel_batch(rank: int):
    return regression_batch(100 + rank, TOKENS[rank], HIDDEN)


def kernel_ranks(rank: int, world_size: int, docs: bool = False) -> Dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if docs:
        model = residual_stack(run_docs_kernel_example()["TanhMLP"], HIDDEN, INTER)  # the example registers its kernel
    else:
        register_kernel(TanhMLPKernel())
        model = residual_stack(TanhMLP, HIDDEN, INTER)
    tiled = [TiledMLP(block.mlp, num_shards=2 + rank) for block in model]
    ddp = DDP(model)
    x, target = _kernel_batch(rank)
    x.requires_grad_(True)
    out = ddp(x)
    (out - target).pow(2).mean().backward()
    return {
        "out": out.detach(), "dx": x.grad,
        "grads": {n.removeprefix("module."): p.grad.clone() for n, p in ddp.named_parameters()},
        "paths": [m.tiling.last_path for m in tiled], "shards": [m.tiling.last_num_shards for m in tiled],
        "strategies": [m.tiling.last_strategy.name for m in tiled], "reasons": [m.tiling.last_reason for m in tiled],
    }


def relative_error(have: torch.Tensor, want: torch.Tensor) -> float:
    return float((have - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("docs", [False, True], ids=["kernel_entry", "docs_example"])
def test_a_registered_kernel_runs_under_ddp_exactly(tmp_path, docs):
    ranks = run_distributed(kernel_ranks, WORLD, tmp_path, docs, timeout=90)
    kernel_name = DOCS_KERNEL_NAME if docs else NAME
    model = residual_stack(TanhMLP, HIDDEN, INTER)  # the same formula and parameter order as the docs' TanhMLP
    inputs = [_kernel_batch(rank) for rank in range(WORLD)]
    xs = [x.clone().requires_grad_(True) for x, _ in inputs]
    outs = [model(x) for x in xs]
    # DDP averages the parameter gradients over the ranks; each rank's input gradient is its own loss's.
    sum((out - target).pow(2).mean() for out, (_, target) in zip(outs, inputs, strict=True)).backward()
    for rank, got in enumerate(ranks):
        assert got["paths"] == [kernel_name] * 2 and got["shards"] == [2 + rank] * 2, (got["paths"], got["shards"])
        assert got["strategies"] == ["ddp"] * 2, got["strategies"]
        assert all(f"kernel {kernel_name!r}" in reason for reason in got["reasons"]), got["reasons"]
        assert relative_error(got["out"], outs[rank].detach()) <= TOL, f"rank {rank}: outputs"
        assert relative_error(got["dx"], xs[rank].grad) <= TOL, f"rank {rank}: input gradients"
        want = {n: p.grad / WORLD for n, p in model.named_parameters()}
        assert got["grads"].keys() == want.keys()
        for name, reference in want.items():
            assert relative_error(got["grads"][name], reference) <= TOL, f"rank {rank} {name}"
