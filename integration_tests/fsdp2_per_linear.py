"""Rank side of the per-Linear FSDP2 test: ``fully_shard`` on each of gate/up/down is rejected.

Two orders: the Linears are FSDP2 units before TiledMLP wraps the MLP (rejected at construction), or
TiledMLP wraps first and the Linears are sharded afterwards (rejected at the first forward, before
the tiled call does any work). Returns what each rank saw, for the test to assert on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tiled_mlp import TiledMLP, UnsupportedBackendError

from .fsdp2_cases import HIDDEN
from .toy_models import make_toy_model

LINEARS = ("gate_proj", "up_proj", "down_proj")


def _shard_per_linear(model: nn.Module, mlps, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer, mlp in zip(model.layers, mlps, strict=True):
        for name in LINEARS:
            fully_shard(getattr(mlp, name), mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def per_linear_outcomes(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}

    # 1. Sharded first, then tiled: TiledMLP's constructor refuses.
    model = make_toy_model(seed=0)
    _shard_per_linear(model, [layer.mlp for layer in model.layers], mesh)
    try:
        TiledMLP(model.layers[0].mlp, num_shards=3)
        out["construction"] = None
    except UnsupportedBackendError as exc:
        out["construction"] = str(exc)

    # 2. Tiled first, then sharded: the first forward refuses before the tiled call runs.
    model = make_toy_model(seed=0, tiled=True, num_shards=3)
    tiled = [layer.mlp for layer in model.layers]
    _shard_per_linear(model, tiled, mesh)
    x = torch.randn(1, (19, 41)[rank % 2], HIDDEN, requires_grad=True)
    try:
        model(x).sum().backward()
        out["forward"] = None
    except UnsupportedBackendError as exc:
        out["forward"] = str(exc)
    # Nothing ran: no tiled call started, no gradient anywhere.
    out["tiled_ran"] = [(t.tiling.last_path, t.tiling.last_num_shards) for t in tiled]
    out["grads"] = [n for n, p in model.named_parameters() if p.grad is not None] + (["x"] if x.grad is not None else [])
    # And no rank is left inside a collective the other one skipped: the group still agrees.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["all_reduce_after"] = total.item()
    return out
