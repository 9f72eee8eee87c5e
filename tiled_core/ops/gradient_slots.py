"""How the map ops run a kernel over token shards (the sharded autograd's loops) and hand its gradients back. A
custom op returns tensors only, so a gradient it did not form is an empty slot (a 0-element tensor of its
input's dtype and device), and the registered backward gives autograd None for it."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ..kernels.base import ShardKernel
from ..shard_plan import make_shard_plan
from ..sharded_autograd import GradAccumulator, backward_shards, forward_shards

NOT_FORMED = 0  # the length of a slot that holds no gradient


def slot(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``grad``, or an empty slot like ``like`` where none was formed."""
    return like.new_empty(NOT_FORMED) if grad is None else grad


def fake_slots(tensors: Sequence[torch.Tensor], formed: Sequence[bool]) -> List[torch.Tensor]:
    """A fake kernel's gradients: contiguous, whatever the tensor's own layout, as the ops form them (rows of the
    flattened input, products of ``mm``); a fake copying the input's layout would tell the compiler wrong strides."""
    return [t.new_empty(t.shape) if f else t.new_empty(NOT_FORMED) for t, f in zip(tensors, formed, strict=True)]


def map_forward(kernel: ShardKernel, x: torch.Tensor, out: torch.Tensor, tensors: Sequence[torch.Tensor],
                num_shards: int) -> torch.Tensor:
    """``out`` (``x``'s leading dims), each of ``num_shards`` token shards written by ``kernel``."""
    x_flat = x.reshape(-1, x.shape[-1])
    plan = make_shard_plan(x_flat.shape[0], num_shards)
    forward_shards(kernel, x_flat, out.view(-1, out.shape[-1]), plan.slice_tuple, tensors)
    return out


def map_backward(kernel: ShardKernel, grad_out: torch.Tensor, x: torch.Tensor, tensors: Sequence[torch.Tensor],
                 num_shards: int, accum_dtype: Optional[torch.dtype], needs: Sequence[bool]) -> List[torch.Tensor]:
    """``[dx, *d tensors]``, recomputed shard by shard; an empty slot where ``needs[i]`` is False, and zeros for a
    needed tensor no shard gave a gradient (a call with no token)."""
    x_flat = x.reshape(-1, x.shape[-1])
    dy_flat = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
    dx_flat = x_flat.new_empty(x_flat.shape) if needs[0] else None  # contiguous, as the fake's
    grads = GradAccumulator(tensors, needs[1:], accum_dtype)
    plan = make_shard_plan(x_flat.shape[0], num_shards)
    backward_shards(kernel, plan.slice_tuple, x_flat, dy_flat, dx_flat, grads, tensors)
    dx = None if dx_flat is None else dx_flat.view_as(x)
    return [slot(dx, x), *(slot(g, t) for t, g in zip(tensors, grads.results(zeros_for_unused=True), strict=True))]


def register_map_autograd(op: Any, backward_op: Any, listed: bool) -> None:
    """The fake of ``backward_op`` and the registered backward of ``op``, a map op whose arguments are ``(x,
    tensors, *options)``: ``tensors`` a list argument where ``listed``, else one tensor. ``save_for_backward``
    refuses an input edited in place after the forward; a double backward is refused (none is registered)."""

    def as_list(tensors: Any) -> List[torch.Tensor]:
        return list(tensors) if listed else [tensors]

    def fake(grad_out, x, tensors, *options):
        return fake_slots((x, *as_list(tensors)), options[-1])

    def setup_context(ctx, inputs, output) -> None:
        x, tensors, *options = inputs
        ctx.save_for_backward(x, *as_list(tensors))
        ctx.options = options

    def backward(ctx, grad_out):
        x, *tensors = ctx.saved_tensors
        flags = ctx.needs_input_grad  # a list argument's flags are a list
        needs = [flags[0], *as_list(flags[1])]
        grads = backward_op(grad_out, x, tensors if listed else tensors[0], *ctx.options, needs)
        dx, *dtensors = [grad if need else None for grad, need in zip(grads, needs, strict=True)]
        return (dx, dtensors if listed else dtensors[0], *[None] * len(ctx.options))

    backward_op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
