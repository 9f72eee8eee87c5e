"""Rank-side half of the FSDP2 tests: build the toy model under ``fully_shard`` as a case says, train
it, and record every full gradient and every full parameter after every optimizer step."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from tiled_mlp import TiledMLP

from .comparison import full_tensor
from .fsdp2_cases import HIDDEN, LR, STEPS, Fsdp2Case
from .toy_models import make_toy_model
from .training_record import new_record, note_tiled_calls

KINDS = ("untiled", "tiled")



def fsdp2_micro_batch(case: Fsdp2Case, rank: int, index: int):
    """The same (input, target) for a rank and micro-batch index in every run and the reference."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(1, case.tokens(rank), HIDDEN, generator=g)
    return x, torch.randn(x.shape, generator=g)


def fsdp2_base_model(case: Fsdp2Case, dtype=torch.float32) -> nn.Module:
    model = make_toy_model(seed=0, lora=case.lora).to(dtype)
    if case.frozen_input:
        for p in (*model.in_proj.parameters(), *model.layers[0].norm.parameters()):
            p.requires_grad_(False)
    return model


def fsdp_kwargs(case: Fsdp2Case, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = dict(mesh=init_device_mesh("cpu", (world_size,)), reshard_after_forward=case.reshard_after_forward)
    if case.mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case.cpu_offload:
        # pin_memory needs an accelerator; on a CPU mesh the "offload" is to the same memory.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return kwargs


def build_fsdp2_model(case: Fsdp2Case, kind: str, rank: int, world_size: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = fsdp2_base_model(case)
    kwargs = fsdp_kwargs(case, world_size)

    def tile(mlp: nn.Module) -> nn.Module:
        if kind != "tiled":
            return mlp
        return TiledMLP(mlp, num_shards=case.shards(rank), path=case.path,
                        grad_accum_dtype=case.grad_accum_dtype, strategy=case.strategy)

    for layer in model.layers:
        if case.wrap == "mlp":
            fully_shard(layer.mlp, **kwargs)  # the MLP is an FSDP2 unit before TiledMLP wraps it
        layer.mlp = tile(layer.mlp)
        if case.wrap == "tiled":
            fully_shard(layer.mlp, **kwargs)
        if case.wrap == "layers":
            fully_shard(layer, **kwargs)
        if case.record_ancestors and kind == "tiled":
            layer.mlp.tiling.set_ancestors([model, layer])
    fully_shard(model, **kwargs)
    return model


def full_float(t: torch.Tensor) -> torch.Tensor:
    """``full_tensor`` in float32 (the bf16 runs' gradients too)."""
    return full_tensor(t).float()


def train_fsdp2(case: Fsdp2Case, kind: str, rank: int, world_size: int) -> Dict:
    model = build_fsdp2_model(case, kind, rank, world_size)
    named = list(model.named_parameters())  # tiled in place: the same names as untiled
    trainable = [p for _, p in named if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR)
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record = new_record()
    record["initial"] = {n: full_float(p) for n, p in named}
    for step in range(STEPS):
        for micro in range(case.gas):
            # Reduce-scatter only at the last micro-batch; before it FSDP2 keeps unsharded sums.
            model.set_requires_gradient_sync(micro == case.gas - 1)
            x, target = fsdp2_micro_batch(case, rank, step * case.gas + micro)
            loss = ((model(x).float() - target) ** 2).mean() / case.gas
            loss.backward()
            note_tiled_calls(record, tiled)
        record["grads"].append({n: full_float(p.grad) for n, p in named if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: full_float(p) for n, p in named})
    return record


def train_fsdp2_cases(rank: int, world_size: int, cases: List[Fsdp2Case]) -> Dict:
    """``{case.name: {kind: record}}`` for every case, untiled and tiled."""
    results = {}
    for case in cases:
        results[case.name] = {kind: train_fsdp2(case, kind, rank, world_size) for kind in KINDS}
        dist.barrier()
    return results
