"""The shard loops every driver of a kernel runs: the sharded autograd Functions (``sharded_autograd``,
``sharded_reduce``) and the custom ops that torch.compile traces as one node (``ops/``).

Forward writes each shard's output into its rows of one output; backward recomputes one shard at a
time, writing its input gradient into its rows and adding its parameters' gradients to one buffer
each (``GradAccumulator``), replaying a shard's RNG state where one was kept. A reduction (a loss)
sums its shards' contributions, each shard forming its gradients at once.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .grad_accum import GradAccumulator
from .kernels.base import ReduceKernel, ShardKernel
from .rng import replay_rng_state


def forward_shards(kernel: ShardKernel, x_flat: torch.Tensor, out_flat: torch.Tensor, slices: Sequence[slice],
                   tensors: Sequence[torch.Tensor]) -> None:
    """Each shard of ``x_flat`` (``[tokens, hidden]``) through the kernel, into its rows of ``out_flat``."""
    forward_shard = kernel.forward_shard
    for shard in slices:
        forward_shard(x_flat[shard], out_flat[shard], tensors, shard)


def backward_shards(kernel: ShardKernel, slices: Sequence[slice], x_flat: torch.Tensor, dy_flat: torch.Tensor,
                    dx_flat: Optional[torch.Tensor], grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                    rng_states: Optional[Sequence[Optional[tuple]]] = None) -> None:
    """Each shard recomputed: its input gradient into its rows of ``dx_flat`` (None: not needed), its
    parameters' gradients added to ``grads``; ``rng_states[i]`` replayed around shard ``i`` where not None."""
    backward_shard = kernel.backward_shard
    states = rng_states if rng_states is not None else (None,) * len(slices)
    for shard, rng_state in zip(slices, states, strict=True):
        args = (x_flat[shard], dy_flat[shard], None if dx_flat is None else dx_flat[shard], grads, tensors, shard)
        if rng_state is None:
            backward_shard(*args)
            continue
        with replay_rng_state(x_flat.device, rng_state):
            backward_shard(*args)


def reduce_shards(kernel: ReduceKernel, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                  dx_flat: Optional[torch.Tensor], grads: Optional[GradAccumulator], params: Sequence[torch.Tensor],
                  slices: Sequence[slice]) -> torch.Tensor:
    """The sum over shards of the kernel's shard losses of ``x`` (``[..., tokens, hidden]``) against
    ``targets`` (``[..., tokens]``), each times ``scale``; each shard's input gradient into its rows of
    ``dx_flat`` and its parameters' added to ``grads``, where given."""
    x_flat = x.detach().reshape(-1, x.shape[-1])
    target_flat = targets.reshape(-1)
    compute = kernel.compute_tensors(x, params)
    total: Optional[torch.Tensor] = None
    for shard in slices:
        loss = kernel.shard(x_flat[shard], target_flat[shard], scale, None if dx_flat is None else dx_flat[shard],
                            grads, compute)
        total = loss if total is None else total.add_(loss)
    assert total is not None  # a plan has at least one shard
    return total
