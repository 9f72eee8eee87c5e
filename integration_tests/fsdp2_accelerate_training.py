"""Rank side of the accelerate test: the toy model prepared by ``Accelerator`` with an FSDP2 plugin.

On CPU, accelerate never enables FSDP by itself: with an initialised gloo group its state says
``MULTI_CPU`` and it ignores the plugin (it only switches to FSDP on accelerator devices). We set the
distributed type and the plugin on the shared state by hand; from there ``prepare`` runs its real
FSDP2 path (``fsdp2_prepare_model``: auto-wrap of the decoder blocks with ``fully_shard``, then the
root), which is what runs on GPUs.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from tiled_mlp import TiledMLP

from .fsdp2_cases import LR, STEPS, Fsdp2Case
from .fsdp2_training import fsdp2_base_model, fsdp2_micro_batch, full_float
from .training_record import new_record, note_tiled_calls

CASE = Fsdp2Case("accelerate", num_shards=3)


def _plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        reshard_after_forward=True,
    )


def _force_fsdp2(accelerator, plugin) -> None:
    """See the module docstring: on CPU accelerate leaves FSDP off, so switch it on explicitly. Done
    before every ``prepare``: with accelerate 1.15 a ``prepare`` can leave the state back at ``MULTI_CPU``,
    and a second model is then wrapped in DDP."""
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2


def train_fsdp2_accelerate(accelerator, kind: str, rank: int) -> Dict:
    from torch.distributed.fsdp import FSDPModule

    model = fsdp2_base_model(CASE)
    if kind == "tiled":
        for layer in model.layers:
            layer.mlp = TiledMLP(layer.mlp, num_shards=CASE.shards(rank))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    _force_fsdp2(accelerator, _plugin())
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, FSDPModule) and all(isinstance(layer, FSDPModule) for layer in model.layers)
    named = list(model.named_parameters())  # tiled in place: the same names as untiled
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record = new_record()
    record["initial"] = {n: full_float(p) for n, p in named}
    for step in range(STEPS):
        x, target = fsdp2_micro_batch(CASE, rank, step)
        loss = ((model(x) - target) ** 2).mean()
        accelerator.backward(loss)
        note_tiled_calls(record, tiled)
        record["grads"].append({n: full_float(p.grad) for n, p in named if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: full_float(p) for n, p in named})
    return record


def train_with_accelerate(rank: int, world_size: int) -> Dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, fsdp_plugin=_plugin())
    out = {kind: train_fsdp2_accelerate(accelerator, kind, rank) for kind in ("untiled", "tiled")}
    dist.barrier()
    return out
