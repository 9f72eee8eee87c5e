"""``torch.ops.tiled_mlp.gated_mlp``: the gated fast kernel (``kernels/gated.py``) over token shards as one
custom op with a registered backward, so that a compiled model traces a tiled gated MLP without a graph break.

A pure function of its arguments, as a graph node must be (the projections' tensors, their layout
``GatedLayout.as_args``, the activation's name, the shard count, the gradients' dtype). ``save_for_backward``
refuses an input edited in place after the forward; backward recomputes gate and up per shard and never down's
forward; a double backward is refused by autograd (none is registered).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..kernels.gated import DOWN_WEIGHT_ARG, GatedLayout, GatedShardKernel, gated_activation
from .gradient_slots import fake_slots, map_backward, map_forward, needed_only


def _kernel(tensors: Sequence[torch.Tensor], slots: Sequence[int], scales: Sequence[float], activation: str,
            use_fused: bool, device: torch.device) -> GatedShardKernel:
    return GatedShardKernel(GatedLayout.from_args(slots, scales), gated_activation(activation, device, use_fused),
                            list(tensors))


def _down_rows(tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> int:
    """The output width: the down projection's rows."""
    return tensors[slots[DOWN_WEIGHT_ARG]].shape[0]


@torch.library.custom_op("tiled_mlp::gated_mlp", mutates_args=())
def gated_mlp(x: torch.Tensor, tensors: List[torch.Tensor], slots: List[int], scales: List[float], activation: str,
              use_fused: bool, num_shards: int, accum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``down(act(gate(x) * gs) * (up(x) * us)) * ds`` over ``num_shards`` token shards, no intermediate kept."""
    kernel = _kernel(tensors, slots, scales, activation, use_fused, x.device)
    return map_forward(kernel, x, x.new_empty((*x.shape[:-1], _down_rows(tensors, slots))), tensors, num_shards)


@gated_mlp.register_fake
def _gated_mlp_fake(x, tensors, slots, scales, activation, use_fused, num_shards, accum_dtype):
    return x.new_empty((*x.shape[:-1], _down_rows(tensors, slots)))


@torch.library.custom_op("tiled_mlp::gated_mlp_backward", mutates_args=())
def gated_mlp_backward(grad_out: torch.Tensor, x: torch.Tensor, tensors: List[torch.Tensor], slots: List[int],
                       scales: List[float], activation: str, use_fused: bool, num_shards: int,
                       accum_dtype: Optional[torch.dtype], needs: List[bool]) -> List[torch.Tensor]:
    """``[dx, *d tensors]``, each recomputed shard by shard; ``needs[i]`` False: an empty slot."""
    kernel = _kernel(tensors, slots, scales, activation, use_fused, x.device)
    return map_backward(kernel, grad_out, x, tensors, num_shards, accum_dtype, needs)


@gated_mlp_backward.register_fake
def _gated_mlp_backward_fake(grad_out, x, tensors, slots, scales, activation, use_fused, num_shards, accum_dtype, needs):
    return fake_slots((x, *tensors), needs)


def _setup_context(ctx, inputs, output) -> None:
    x, tensors, slots, scales, activation, use_fused, num_shards, accum_dtype = inputs
    ctx.save_for_backward(x, *tensors)
    ctx.options = (slots, scales, activation, use_fused, num_shards, accum_dtype)


def _backward(ctx, grad_out):
    x, *tensors = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], *ctx.needs_input_grad[1]]  # a list argument's flags are a list
    grads = gated_mlp_backward(grad_out, x, tensors, *ctx.options, needs)
    dx, *dtensors = needed_only(grads, needs)
    return dx, dtensors, None, None, None, None, None, None


gated_mlp.register_autograd(_backward, setup_context=_setup_context)
