"""Modelled peak memory of one step with fake tensors: the seed's full sizes on any machine.

Nothing is allocated: ``FakeTensorMode`` carries shapes and dtypes only, and the live-storage tracker
adds up what a real run would hold. ``plan`` uses the same model to pick a shard count.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .impls import IMPLS
from .measure import peak_bytes, shards_used
from .mlp import SwiGLUMLP


def modeled_step(impl: str, hidden: int, intermediate: int, seq: int, dtype=torch.bfloat16,
                 num_shards=4, batch: int = 1, device: str = "cpu"):
    """(peak bytes, shard count the step used) of one modelled forward+backward."""
    with FakeTensorMode():
        mlp = SwiGLUMLP(hidden, intermediate, dtype=dtype, device=device)
        x = torch.empty(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
        grad_out = torch.empty(batch, seq, hidden, dtype=dtype, device=device)
        step_fn = IMPLS[impl](mlp, num_shards)
        peak = peak_bytes(step_fn, mlp, x, grad_out)
        return peak, shards_used(step_fn, num_shards)


def modeled_peak_bytes(*args, **kwargs) -> int:
    return modeled_step(*args, **kwargs)[0]
