"""The attention the planner models: causal, with no [tokens, tokens] buffer, as every long-context
training run uses (FlashAttention-2/3 on GPUs, SDPA's flash kernels).

Registered with transformers under its own name, which also skips transformers' mask construction: a
causal run without padding needs no mask, and building one on the meta device would read its values.
The kernel is aten's flash attention for CPU, which has meta shapes and handles grouped KV heads
natively (no repeated K/V): it saves the query, key, value, output and a float32 log-sum-exp per head
and token, the same tensors FlashAttention-2 saves on a GPU. Softcapping and sliding windows (Gemma-2)
change the numbers, not the memory, so they are left out.
"""
from __future__ import annotations

import torch

NAME = "tiled_mlp_planner_causal"


def causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_attention)
    return NAME
