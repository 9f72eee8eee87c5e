"""The single-process reference for an FSDP2 case: no FSDP, no tiling, in float32 or float64.

FSDP2 averages gradients over ranks (each rank's loss is a mean over its own tokens), so one
reference step sums, over micro-batches and ranks, each rank's loss divided by ``gas * world``.
"""
from __future__ import annotations

from typing import Dict

import torch

from .fsdp2_cases import LR, STEPS, Fsdp2Case
from .fsdp2_training import fsdp2_base_model, fsdp2_micro_batch


def fsdp2_reference_run(case: Fsdp2Case, world_size: int, dtype: torch.dtype) -> Dict:
    model = fsdp2_base_model(case, dtype=dtype)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named if p.requires_grad], lr=LR)
    record = {"grads": [], "params": [], "initial": {n: p.detach().clone() for n, p in named}}
    for step in range(STEPS):
        for micro in range(case.gas):
            for rank in range(world_size):
                x, target = fsdp2_micro_batch(case, rank, step * case.gas + micro)
                loss = ((model(x.to(dtype)) - target.to(dtype)) ** 2).mean() / (case.gas * world_size)
                loss.backward()
        record["grads"].append({n: p.grad.detach().clone() for n, p in named if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: p.detach().clone() for n, p in named})
    return record
