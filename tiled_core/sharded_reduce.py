"""The reduction shape of the sharded autograd: a sum over token shards (a loss), one scalar out.

Forward runs the kernel one shard at a time and, where a gradient is wanted, forms the shard's
gradients at once: the input's into one ``[tokens, hidden]`` buffer, the parameters' summed over
shards (``GradAccumulator``). No ``[tokens, vocab]`` tensor outlives its shard, nothing is recomputed,
and the parameters are read only inside the one ``gathered`` region around the call (ZeRO-3 gathers a
partitioned ``lm_head`` once per call, never per shard).

Backward scales every precomputed gradient by the gradient that arrives (the output is a scalar, so
``d(c * loss) = c * d(loss)`` exactly: ``loss * c`` and ``loss / N`` are exact for the input *and* the
parameters, where DeepSpeed's ``TiledFusedLogitsLoss`` scales only the input's) and delivers them
through ``grad_delivery``, the map shape's own delivery: once per parameter per backward.

The gradients are formed for the loss as it was computed in forward, so a tensor edited in place
between forward and backward does not matter: nothing is read again. What is refused, as by the map
shape: a backward that builds a graph (double backward), and a second backward through the same call
(the precomputed gradients were handed over by the first).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .grad_accum import GradAccumulator
from .grad_delivery import delivered_grads, needed_grads
from .kernels.base import ReduceKernel
from .shard_loops import reduce_shards
from .sharded_autograd import ShardedRun

LOSS_DOUBLE_BACKWARD_ERROR = (
    "the tiled loss does not support double backward: a backward with create_graph=True reached it (a Hessian, "
    "a gradient penalty). Its gradients were formed in forward without a graph, so every second-order term "
    "through it would be zero. Compute this loss untiled for second-order gradients."
)
SECOND_BACKWARD_ERROR = (
    "tiled loss: backward was run a second time through the same call (retain_graph=True). Its gradients were "
    "formed in forward and handed over by the first backward; compute the loss again for another backward."
)


class ShardedReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, run: ShardedRun[ReduceKernel], building_graph: bool,
                *params: torch.Tensor) -> torch.Tensor:
        # ``needs_input_grad`` says what requires grad, also under no_grad: ``building_graph`` is the
        # caller's grad mode (no gradient is formed for a loss computed without a graph).
        num_params = len(params)
        needs = [building_graph and need for need in ctx.needs_input_grad]
        needed = needed_grads(run, needs[5:], num_params)
        grads = GradAccumulator(params, needed, run.grad_accum_dtype) if any(needed) else None
        dx_flat = x.new_empty((x.numel() // x.shape[-1], x.shape[-1])) if needs[0] else None
        total = reduce_shards(run.kernel, x, targets, scale, dx_flat, grads, params, run.plan.slice_tuple)
        ctx.dx = None if dx_flat is None else dx_flat.view_as(x)
        ctx.param_grads = delivered_grads(run, grads, params, num_params) if grads is not None else [None] * num_params
        return total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError(LOSS_DOUBLE_BACKWARD_ERROR)
        if ctx.param_grads is None:
            raise RuntimeError(SECOND_BACKWARD_ERROR)
        # Handed over to autograd: no second reference keeps them alive after this backward.
        dx, param_grads = ctx.dx, ctx.param_grads
        ctx.dx = ctx.param_grads = None
        # A 0-dim factor: the product is taken at the wider precision and rounded once (a bf16 gradient
        # is not multiplied by a bf16-rounded ``1 / N``). In place: the forward made each buffer and nothing
        # else references it (no second [tokens, hidden] or [vocab, hidden] buffer at the loss's backward);
        # under torch.compile, AOT autograd turns the in-place product into a functional one.
        scaled = [None if g is None else g.mul_(grad_loss) for g in (dx, *param_grads)]
        return (scaled[0], None, None, None, None, *scaled[1:])


def sharded_reduce(x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, run: ShardedRun[ReduceKernel],
                   params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum over shards of ``run.kernel``'s shard losses (each times ``scale``). Call it inside the
    strategy's gathered region: autograd records the parameters' shapes here, whole."""
    return ShardedReduceFunction.apply(x, targets, scale, run, torch.is_grad_enabled(), *params)
