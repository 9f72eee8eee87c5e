"""The token-sharded autograd Function shared by every per-shard kernel.

Forward: flatten the leading dims into tokens, run the kernel one shard at a time under no_grad into
one preallocated output, save only the input (plus each shard's RNG state).
Backward: recompute one shard at a time and sum the parameter gradients over shards.

The parameters are *inputs* of the Function and their summed gradients are returned from
``backward``, so autograd accumulates each parameter's gradient exactly once per backward. That
single delivery is what DDP's reducer, FSDP2's reduce-scatter and ZeRO's gradient hooks expect
(any shard count, ``no_sync`` included); nothing backend-specific happens in here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch
from torch.autograd.function import once_differentiable

from .autocast_state import AutocastState
from .grad_accum import GradAccumulator
from .kernels.base import ShardKernel
from .rng import capture_rng_state, replay_rng_state
from .shard_plan import ShardPlan


@dataclass
class ShardedRun:
    """Everything one tiled call needs besides its tensors."""

    kernel: ShardKernel
    plan: ShardPlan
    # Re-gathers the parameters for the backward recompute (a backend's strategy decides how).
    gathered: Callable[[], ContextManager] = contextlib.nullcontext
    # Returns the parameters the module would use now; checked against the forward's in backward.
    current_params: Optional[Callable[[], List[torch.Tensor]]] = None
    grad_accum_dtype: Optional[torch.dtype] = None
    replay_rng: bool = True


class ShardedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, run: ShardedRun, *params: torch.Tensor) -> torch.Tensor:
        x_flat = x.reshape(-1, x.shape[-1])
        out = None
        rng_states = []
        for shard in run.plan.slices():
            rng_states.append(capture_rng_state(x.device) if run.replay_rng else None)
            if out is None:
                first = run.kernel.forward_shard(x_flat[shard], None)
                # Allocate the whole output once (no torch.cat peak of shards + result).
                out = first.new_empty((x_flat.shape[0], first.shape[-1]))
                out[shard].copy_(first)
                del first
            else:
                run.kernel.forward_shard(x_flat[shard], out[shard])
        ctx.save_for_backward(x)
        ctx.run = run
        ctx.rng_states = rng_states
        # Plain references, not saved tensors: backends swap parameter storage between forward and
        # backward (ZeRO-3 replaces .data, FSDP2 frees and re-allocates) without it being a mutation.
        ctx.params = params
        ctx.autocast = AutocastState.capture(x.device)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        run: ShardedRun = ctx.run
        params = ctx.params
        need_dx = ctx.needs_input_grad[0]
        grads = GradAccumulator(params, ctx.needs_input_grad[2:], run.grad_accum_dtype)

        x_flat = x.reshape(-1, x.shape[-1])
        dy_flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        dx_flat = torch.empty_like(x_flat) if need_dx else None

        with run.gathered():
            if run.current_params is not None:
                _check_same_params(params, run.current_params())
            for shard, rng_state in zip(run.plan.slices(), ctx.rng_states):
                with replay_rng_state(x.device, rng_state), ctx.autocast.replay():
                    run.kernel.backward_shard(
                        x_flat[shard], dy_flat[shard], None if dx_flat is None else dx_flat[shard], grads
                    )
            # Inside the gathered region: zeros for an unused parameter need its whole shape.
            param_grads = grads.results()
        dx = None if dx_flat is None else dx_flat.view_as(x)
        return (dx, None, *param_grads)


def _check_same_params(saved, current) -> None:
    if len(saved) != len(current) or any(a is not b for a, b in zip(saved, current)):
        raise RuntimeError(
            "TiledMLP: the module's trainable parameters in backward are not the tensors it used in forward "
            "(a backend replaced them in between, or requires_grad changed). Gradients would be lost, so "
            "backward stops here; keep requires_grad fixed within a step, or report the backend."
        )


def sharded_apply(x: torch.Tensor, run: ShardedRun) -> torch.Tensor:
    return ShardedMLPFunction.apply(x, run, *run.kernel.params)
