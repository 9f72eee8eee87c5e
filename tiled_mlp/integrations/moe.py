"""Tiling the experts of a mixture-of-experts block, leaving its router untiled.

Why not tile the whole sparse block: its router runs inside the shard loop, whose forward builds no
autograd graph, so router logits that transformers records for the load-balancing loss
(``output_router_logits``) would carry no gradient (measured: the tiled Mixtral's ``aux_loss`` had no
``grad_fn``). The router is small (``[tokens, experts]``); the experts hold the large intermediates.

transformers' fused experts modules (Mixtral, Qwen3-MoE and ~60 others) are called as
``experts(hidden_states, top_k_index, top_k_weights)``, each row one token, so they are token-wise
with three inputs. ``TiledExperts`` (tiled in place, like ``TiledMLP``: same call, same names) shards
the hidden states and passes the indices (integers, as they are) and the routing weights as the tiled
call's other sharded inputs (``token_inputs``), sliced like the hidden states. The routing weights need a
gradient (it reaches the router): the sharded core finds them read by the first shard and makes them an
input of its Function, as any tensor a forward reads.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from tiled_mlp.core import TiledInputs, TiledMLP

FUSED_EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
# The experts' weights are 3-D parameters, not gated Linears: the gated fast kernel never applies.
FUSED_EXPERTS = "its weights are not gated nn.Linear projections (fused MoE experts)"


def is_fused_experts(module: nn.Module) -> bool:
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names == FUSED_EXPERTS_INPUTS


class TiledExperts(TiledMLP):
    """Tiles a fused experts module in place: same call, same parameters and names."""

    tiled_no_fast_path = FUSED_EXPERTS

    def tiled_inputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> TiledInputs:
        # The routing is sharded with the hidden states: each shard's rows keep their own experts and weights.
        return TiledInputs(hidden_states, token_inputs=(top_k_index, top_k_weights), check_hidden=False)
