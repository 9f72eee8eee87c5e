"""``torch.ops.tiled_mlp.gated_mlp``: the gated fast kernel over token shards as one custom op, so that a
compiled model traces a tiled gated MLP without a graph break. A pure function of its arguments (the
projections' tensors, their ``GatedLayout``'s slots and factors, the activation, the shard count, the gradients' dtype);
backward recomputes gate and up per shard and never down's forward.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..kernels.gated import DOWN_WEIGHT_ARG, GatedLayout, GatedShardKernel, gated_activation
from .gradient_slots import map_backward, map_forward, register_map_autograd


def _kernel(tensors: Sequence[torch.Tensor], slots: Sequence[int], scales: Sequence[float], activation: str,
            use_fused: bool, device: torch.device) -> GatedShardKernel:
    return GatedShardKernel(GatedLayout(tuple(slots), tuple(scales)), gated_activation(activation, device, use_fused),
                            list(tensors))


def _output_like(x: torch.Tensor, tensors: Sequence[torch.Tensor], slots: Sequence[int]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], tensors[slots[DOWN_WEIGHT_ARG]].shape[0]))


@torch.library.custom_op("tiled_mlp::gated_mlp", mutates_args=())
def gated_mlp(x: torch.Tensor, tensors: List[torch.Tensor], slots: List[int], scales: List[float], activation: str,
              use_fused: bool, num_shards: int, accum_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``down(act(gate(x) * gs) * (up(x) * us)) * ds`` over ``num_shards`` token shards, no intermediate kept."""
    kernel = _kernel(tensors, slots, scales, activation, use_fused, x.device)
    return map_forward(kernel, x, _output_like(x, tensors, slots), tensors, num_shards)


@gated_mlp.register_fake
def _gated_mlp_fake(x, tensors, slots, scales, activation, use_fused, num_shards, accum_dtype):
    return _output_like(x, tensors, slots)


@torch.library.custom_op("tiled_mlp::gated_mlp_backward", mutates_args=())
def gated_mlp_backward(grad_out: torch.Tensor, x: torch.Tensor, tensors: List[torch.Tensor], slots: List[int],
                       scales: List[float], activation: str, use_fused: bool, num_shards: int,
                       accum_dtype: Optional[torch.dtype], needs: List[bool]) -> List[torch.Tensor]:
    """``[dx, *d tensors]``, each recomputed shard by shard; ``needs[i]`` False: an empty slot."""
    kernel = _kernel(tensors, slots, scales, activation, use_fused, x.device)
    return map_backward(kernel, grad_out, x, tensors, num_shards, accum_dtype, needs)


register_map_autograd(gated_mlp, gated_mlp_backward, listed=True)
