"""``torch.ops.tiled_mlp.rms_norm``: the norm kernel over token shards as one custom op, so that a compiled model
traces a tiled RMSNorm without a graph break. A pure function of its arguments (the input, the weight, the
form's eps, offset and multiply dtype, the shard count, the gradient's dtype); backward recomputes per shard.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..kernels.rms_norm import NormLayout, RMSNormShardKernel
from .gradient_slots import map_backward, map_forward, register_map_autograd


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


register_map_autograd(rms_norm, rms_norm_backward, listed=False)
