"""How the map ops run a kernel over token shards (the sharded autograd's loops, ``sharded_autograd``) and
hand its gradients back. A custom op returns tensors only, so a gradient it did not form is an empty slot (a
0-element tensor of its input's dtype and device), and the registered backward gives autograd None for it."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..kernels.base import ShardKernel
from ..shard_plan import make_shard_plan
from ..sharded_autograd import GradAccumulator, backward_shards, forward_shards

NOT_FORMED = 0  # the length of a slot that holds no gradient


def slot(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``grad``, or an empty slot like ``like`` where none was formed."""
    return like.new_empty(NOT_FORMED) if grad is None else grad


def fake_slots(tensors: Sequence[torch.Tensor], formed: Sequence[bool]) -> List[torch.Tensor]:
    """A fake kernel's gradients: one of each tensor's shape where it is formed, else an empty slot. Contiguous,
    whatever the tensor's own layout (a transposed input, a column-major weight), as the ops form them: rows of
    the flattened input (``flat_like``) and products of ``mm``. A fake that copied the input's layout
    (``empty_like``) would tell the compiler strides the op does not return."""
    return [t.new_empty(t.shape) if f else t.new_empty(NOT_FORMED) for t, f in zip(tensors, formed, strict=True)]


def flat_like(x_flat: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer of ``x_flat``'s shape (``[tokens, hidden]``): where an op writes an input gradient, so
    that its layout is the fake kernel's (``fake_slots``) whatever the input's."""
    return x_flat.new_empty(x_flat.shape)


def needed_only(grads: Sequence[torch.Tensor], needs: Sequence[bool]) -> List[Optional[torch.Tensor]]:
    """What the backward gives autograd: each gradient that is needed, None for the others."""
    return [g if need else None for g, need in zip(grads, needs, strict=True)]


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
    dx_flat = flat_like(x_flat) if needs[0] else None
    grads = GradAccumulator(tensors, needs[1:], accum_dtype)
    plan = make_shard_plan(x_flat.shape[0], num_shards)
    backward_shards(kernel, plan.slice_tuple, x_flat, dy_flat, dx_flat, grads, tensors)
    dx = None if dx_flat is None else dx_flat.view_as(x)
    return [slot(dx, x), *(slot(g, t) for t, g in zip(tensors, grads.results(zeros_for_unused=True), strict=True))]
