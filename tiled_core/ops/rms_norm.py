"""``torch.ops.tiled_mlp.rms_norm``: the norm kernel (``kernels/rms_norm.py``) over token shards as one custom
op with a registered backward, so that a compiled model traces a tiled RMSNorm without a graph break.

A pure function of its arguments (the input, the weight, the form's eps, offset and multiply dtype from
``norm_forms``, the shard count, the gradient's dtype). ``save_for_backward`` refuses an input edited in place
after the forward; backward recomputes per shard; a double backward is refused by autograd.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..kernels.rms_norm import RMSNormShardKernel
from ..norm_forms import NormLayout
from .gradient_slots import fake_slots, map_backward, map_forward, needed_only


def _output_like(x: torch.Tensor, weight: torch.Tensor, layout: NormLayout) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=layout.output_dtype(x.dtype, weight.dtype))


@torch.library.custom_op("tiled_mlp::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, multiply: str, num_shards: int,
             accum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The registered norm formula (``norm_forms``) over ``num_shards`` token shards."""
    layout = NormLayout(eps, offset, multiply)
    return map_forward(RMSNormShardKernel(layout, weight), x, _output_like(x, weight, layout), [weight], num_shards)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, offset, multiply, num_shards, accum_dtype):
    return _output_like(x, weight, NormLayout(eps, offset, multiply))


@torch.library.custom_op("tiled_mlp::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                      multiply: str, num_shards: int, accum_dtype: Optional[torch.dtype],
                      needs: List[bool]) -> List[torch.Tensor]:
    """``[dx, dweight]``, recomputed shard by shard; ``needs[i]`` False: an empty slot (a call with no token
    gives the weight zeros, as untiled)."""
    kernel = RMSNormShardKernel(NormLayout(eps, offset, multiply), weight)
    return map_backward(kernel, grad_out, x, [weight], num_shards, accum_dtype, needs)


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad_out, x, weight, eps, offset, multiply, num_shards, accum_dtype, needs):
    return fake_slots((x, weight), needs)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, offset, multiply, num_shards, accum_dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.options = (eps, offset, multiply, num_shards, accum_dtype)


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    dx, dweight = needed_only(rms_norm_backward(grad_out, x, weight, *ctx.options, needs), needs)
    return dx, dweight, None, None, None, None, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)
