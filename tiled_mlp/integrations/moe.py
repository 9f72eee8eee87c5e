"""Tiling the experts of a mixture-of-experts block, leaving its router untiled.

Why not tile the whole sparse block: its router runs inside the shard loop, whose forward builds no
autograd graph, so router logits that transformers records for the load-balancing loss
(``output_router_logits``) would carry no gradient (measured: the tiled Mixtral's ``aux_loss`` had no
``grad_fn``). The router is small (``[tokens, experts]``); the experts hold the large intermediates.

transformers' fused experts modules (Mixtral, Qwen3-MoE and ~60 others) are called as
``experts(hidden_states, top_k_index, top_k_weights)``, each row one token, so they are token-wise
but take three inputs while the tiled call shards one. ``TiledExperts`` (tiled in place, like
``TiledMLP``: same call, same names) packs the three into one ``[tokens, hidden + 2k]`` tensor (in
float32 or wider, so expert indices and bf16 values are exact), tiles that, and unpacks each shard.
The routing weights' gradient (which reaches the router) flows back through the packed tensor.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from tiled_core.module import TiledMLP

FUSED_EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def is_fused_experts(module: nn.Module) -> bool:
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names == FUSED_EXPERTS_INPUTS


@dataclass(frozen=True)
class PackedLayout:
    """Where the three inputs sit in a packed row, and the dtypes to unpack them to."""

    hidden: int
    top_k: int
    hidden_dtype: torch.dtype
    weights_dtype: torch.dtype


class TiledExperts(TiledMLP):
    """Tiles a fused experts module in place: same call, same parameters and names."""

    # The experts' weights are 3-D parameters, not gated Linears: the generic kernel always.
    _tiled_fast_allowed = False

    def _tiled_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        self._tiled_adopt_instance_forward()
        layout = PackedLayout(hidden_states.shape[-1], top_k_index.shape[-1], hidden_states.dtype, top_k_weights.dtype)
        dtype = torch.promote_types(torch.promote_types(hidden_states.dtype, top_k_weights.dtype), torch.float32)
        packed = torch.cat([hidden_states.to(dtype), top_k_weights.to(dtype), top_k_index.to(dtype)], dim=-1)
        return self._tiled_call(packed, functools.partial(self._tiled_unpacked_forward, layout), check_hidden=False)

    def _tiled_unpacked_forward(self, layout: PackedLayout, packed: torch.Tensor) -> torch.Tensor:
        lead = packed.shape[:-1]
        packed = packed.reshape(-1, packed.shape[-1])
        hidden, weights, index = packed.split([layout.hidden, layout.top_k, layout.top_k], dim=-1)
        out = self._tiled_original_forward(hidden.to(layout.hidden_dtype), index.long(), weights.to(layout.weights_dtype))
        return out.reshape(*lead, out.shape[-1])
