"""Tiling the experts of a mixture-of-experts block, leaving its router untiled.

Why not tile the whole sparse block: its router runs inside the shard loop, whose forward builds no
autograd graph, so router logits that transformers records for the load-balancing loss
(``output_router_logits``) would carry no gradient (measured: the tiled Mixtral's ``aux_loss`` had no
``grad_fn``). The router is small (``[tokens, experts]``); the experts hold the large intermediates.

transformers' fused experts modules (Mixtral, Qwen3-MoE and ~60 others) are called as
``experts(hidden_states, top_k_index, top_k_weights)``, each row one token, so they are token-wise
but take three inputs while ``TiledMLP`` passes one. ``TiledExperts`` packs the three into one
``[tokens, hidden + 2k]`` tensor (in float32 or wider, so expert indices and bf16 values are exact),
tiles that, and ``PackedExperts`` unpacks each shard. The routing weights' gradient (which reaches
the router) flows back through the packed tensor. ``state_dict`` keys stay those of the experts.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..tiled_core.module import TiledMLP
from ..tiled_core.state_dict_keys import hide_child_in_state_dict

FUSED_EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
_INNER = "experts"


def is_fused_experts(module: nn.Module) -> bool:
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names == FUSED_EXPERTS_INPUTS


class PackedExperts(nn.Module):
    """``experts`` called on one packed tensor ``[..., hidden | top_k_weights | top_k_index]``."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts
        # The layout of the packed tensor, set by TiledExperts before each call (the backward
        # recompute of that call reads the same values).
        self.hidden, self.top_k = 0, 0
        self.hidden_dtype = self.weights_dtype = torch.float32
        hide_child_in_state_dict(self, _INNER)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        lead = packed.shape[:-1]
        packed = packed.reshape(-1, packed.shape[-1])
        hidden, weights, index = packed.split([self.hidden, self.top_k, self.top_k], dim=-1)
        # Called directly, not through __call__: backend hooks fire once, around the tiled call.
        out = self.experts.forward(hidden.to(self.hidden_dtype), index.long(), weights.to(self.weights_dtype))
        return out.reshape(*lead, out.shape[-1])


class TiledExperts(TiledMLP):
    """Drop-in for a fused experts module: same call, same parameters and ``state_dict`` keys."""

    def __init__(self, experts: nn.Module, **tiled_kwargs):
        super().__init__(PackedExperts(experts), **tiled_kwargs)

    @property
    def original(self) -> nn.Module:
        return self.mlp.experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        packed_module = self.mlp
        packed_module.hidden = hidden_states.shape[-1]
        packed_module.top_k = top_k_index.shape[-1]
        packed_module.weights_dtype = top_k_weights.dtype
        packed_module.hidden_dtype = hidden_states.dtype
        dtype = torch.promote_types(torch.promote_types(hidden_states.dtype, top_k_weights.dtype), torch.float32)
        packed = torch.cat([hidden_states.to(dtype), top_k_weights.to(dtype), top_k_index.to(dtype)], dim=-1)
        return super().forward(packed)

