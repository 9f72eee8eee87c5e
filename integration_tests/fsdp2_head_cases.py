"""Rank side of the FSDP2 head-unit tests: the tiny transformers Llama with ``fully_shard`` applied by hand,
each decoder layer a unit, the root a unit, and the output head in one of the layouts below; the tiled loss
(with tiled MLPs and norms, by the flags) runs inside one call of the head, between its unit's hooks.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from .comparison import full_tensor
from .tiled_loss_steps import LR, run_steps, tiled_by_flags


def _head_alone(reshard: bool) -> Callable:
    def wrap(model, fully_shard) -> None:
        fully_shard(model.lm_head, reshard_after_forward=reshard)
    return wrap


def _norm_and_head(reshard: bool) -> Callable:
    def wrap(model, fully_shard) -> None:
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=reshard)
    return wrap


# layout -> how the head is wrapped (before the root)
LAYOUTS: Dict[str, Callable] = {
    "head alone, resharded after forward": _head_alone(True),
    "head alone, kept after forward": _head_alone(False),
    "norm and head, resharded after forward": _norm_and_head(True),  # accelerate's layout, resharding
}


def train_fsdp2_head(rank: int, world_size: int, layout: str, tiled: bool) -> Dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from integration_tests.tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.float64)
    if tiled:
        tiled_by_flags(model)
    mesh = init_device_mesh("cpu", (world_size,))

    def shard(module, **kwargs):
        return fully_shard(module, mesh=mesh, **kwargs)

    for layer in model.model.layers:
        shard(layer)
    LAYOUTS[layout](model, shard)
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    named = list(model.named_parameters())
    return run_steps(model, named, tiled, rank, lambda loss: loss.backward(), optimizer,
                     lambda p: full_tensor(p.grad), full_tensor)


def both_runs(rank: int, world_size: int, layout: str) -> Dict:
    return {"untiled": train_fsdp2_head(rank, world_size, layout, False), "tiled": train_fsdp2_head(rank, world_size, layout, True)}
