"""Modelled peak memory of one step with fake tensors: the seed's full sizes on any machine.

Nothing is allocated: ``FakeTensorMode`` carries shapes and dtypes only, and the live-storage tracker
adds up what a real run would hold. ``plan`` uses the same model to pick a shard count.

``tp``: one rank of a tensor-parallel MLP (``ColwiseParallel`` gate/up, ``RowwiseParallel`` down): its local
weights (intermediate / tp) and the buffers of its two collectives, each an out-of-place all-reduce of a
``[tokens, hidden]`` tensor (the partial output in forward, the partial input gradient in backward; the
functional all-reduce copies its input and reduces the copy). The tiled kernel issues the same two, once per
call (``strategies/tensor_parallel.py``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .impls import IMPLS
from .measure import peak_bytes, shards_used
from .mlp import SwiGLUMLP


class _OutputAllReduce(torch.autograd.Function):
    """Forward: the all-reduce of the partial output (a new buffer); backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        return partial.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _InputGradAllReduce(torch.autograd.Function):
    """Forward: the input as it is; backward: the all-reduce of the partial input gradient (a new buffer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _tensor_parallel_rank(step_fn: Callable) -> Callable:
    def step(x: torch.Tensor) -> torch.Tensor:
        return _OutputAllReduce.apply(step_fn(_InputGradAllReduce.apply(x)))

    return step


def modeled_step(impl: str, hidden: int, intermediate: int, seq: int, dtype=torch.bfloat16,
                 num_shards=4, batch: int = 1, device: str = "cpu", tp: int = 1):
    """(peak bytes, shard count the step used) of one modelled forward+backward (of one rank, ``tp`` > 1)."""
    if intermediate % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs an intermediate size divisible by {tp}, "
                         f"got {intermediate}")
    with FakeTensorMode():
        mlp = SwiGLUMLP(hidden, intermediate // tp, dtype=dtype, device=device)
        x = torch.empty(batch, seq, hidden, dtype=dtype, device=device, requires_grad=True)
        grad_out = torch.empty(batch, seq, hidden, dtype=dtype, device=device)
        step_fn = IMPLS[impl](mlp, num_shards)
        peak = peak_bytes(step_fn if tp == 1 else _tensor_parallel_rank(step_fn), mlp, x, grad_out)
        return peak, shards_used(step_fn, num_shards)


def modeled_peak_bytes(*args, **kwargs) -> int:
    return modeled_step(*args, **kwargs)[0]
