"""The "auto" shard policy, derived from the fake-tensor memory model (see README, "Auto policy").

Two rules, both cheap enough for every forward:

1. **Shard size**: what no tiling removes (weights and their grads, input, output and both of their
   grads: the *fixed bytes*) sets the scale. A shard's working set is about four ``[tokens,
   intermediate]`` buffers; keeping it under ``WORKING_SET_SHARE`` (1/8) of the fixed bytes puts the
   peak within ~12% of that floor. Shards are capped at ``SHARD_INTERMEDIATE_BYTES`` (32 MiB) per
   buffer: at 131072 tokens, hidden 4096, intermediate 12288, bf16 that is 97 shards of ~1365 tokens,
   0.219 of untiled, within 3% of the floor (0.213: input, output, their gradients, weights and
   theirs), where 64 MiB gave 0.225 and 193 shards 0.216; ~1.4K tokens still keep a GPU's matrix
   units busy. (Fused MoE experts see only shard x top-k / experts tokens each and take the
   hidden-size rule below, so their shards stay large.) Shards are floored at ``MIN_TOKENS_PER_SHARD`` (1024) so smaller MLPs
   are not cut into slivers that only add time: hidden 1024, intermediate 2816, 8192 tokens, CPU fp32,
   the fast path took 1.23x the untiled step with 4 shards of 2048 tokens, 1.25x with 8 of 1024 and
   1.36x with 15 of 546 (README, "Auto policy").
2. **Pass-through**: tiling costs recompute (11 matmul units against 9) and some fixed buffers, so it
   only pays when the intermediates it stops keeping are a real share of the step's memory. When the
   whole call's intermediate bytes are under ``MIN_INTERMEDIATE_SHARE`` of the fixed bytes, "auto"
   runs the module untiled: at 2048 tokens of the 4096/12288 model, tiling would save at most 4-9%
   of the peak for ~20% more time, and with one or two shards it raises the peak. So does the
   generic path where its extra buffers (a second copy of the trainable parameters' gradients, a
   shard's input gradient and output) outweigh what the shards save, one shard always: a LoRA MLP
   in one shard reached 1.07x untiled, a small GELU MLP 1.19x (measured with the exact tracker;
   ``tests/test_auto_policy.py`` sweeps such modules).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch import nn

from .validation import INPUT_PROJECTIONS

SHARD_INTERMEDIATE_BYTES = 32 * 2**20
WORKING_SET_SHARE = 1 / 8
WORKING_SET_BUFFERS = 4
MIN_TOKENS_PER_SHARD = 1024
MIN_INTERMEDIATE_SHARE = 0.1
# The fewest [tokens, intermediate] tensors untiled autograd keeps for an MLP with an activation
# between its projections. A lower bound, so the generic path never tiles where it cannot pay; with
# one (an earlier version) a SwiGLU at 4096 tokens ran untiled, where 4 shards take 0.59x the memory.
GENERIC_SAVED_INTERMEDIATES = 2



@dataclass(frozen=True, slots=True)
class MLPSize:
    """What the policy needs to know about a module, read without running it."""

    hidden: int
    intermediate: Optional[int]  # None: unknown (the policy falls back to ~hidden tokens per shard)
    weight_bytes: int
    element_bytes: int
    # The generic path's extra working set: its recompute returns a shard's parameter gradients beside
    # the running sums (so the trainable bytes once more) and copies a shard's input gradient and
    # output. None: the fast path, whose buffers the shard-size rule already counts.
    generic_trainable_bytes: Optional[int] = None


def intermediate_size(module: nn.Module) -> Optional[int]:
    fused_features = getattr(getattr(module, "gate_up_proj", None), "out_features", None)
    if isinstance(fused_features, int):
        return fused_features // 2
    for name in INPUT_PROJECTIONS:
        out_features = getattr(getattr(module, name, None), "out_features", None)
        if isinstance(out_features, int):
            return out_features
    # Any other MLP (an nn.Sequential, custom names): its first Linear-like layer's width.
    for sub in module.modules():
        if sub is not module and isinstance(getattr(sub, "in_features", None), int):
            out_features = getattr(sub, "out_features", None)
            return out_features if isinstance(out_features, int) else None
    return None


def fixed_bytes(size: MLPSize, num_tokens: int) -> int:
    """What no shard count removes: weights and their grads, input, output and both of their grads."""
    return 2 * size.weight_bytes + 4 * num_tokens * size.hidden * size.element_bytes


def auto_num_shards(num_tokens: int, size: MLPSize) -> Optional[int]:
    """The shard count for ``num_tokens`` tokens, or None to run the module untiled."""
    if size.intermediate is None:
        return max(1, math.ceil(num_tokens / max(1, size.hidden)))
    intermediate_bytes = num_tokens * size.intermediate * size.element_bytes
    fixed = fixed_bytes(size, num_tokens)
    if intermediate_bytes < MIN_INTERMEDIATE_SHARE * fixed:
        return None
    buffer_bytes = min(SHARD_INTERMEDIATE_BYTES, WORKING_SET_SHARE * fixed / WORKING_SET_BUFFERS)
    tokens_per_shard = max(MIN_TOKENS_PER_SHARD, int(buffer_bytes // (size.intermediate * size.element_bytes)))
    num_shards = math.ceil(num_tokens / tokens_per_shard)
    if size.generic_trainable_bytes is not None:
        # Untiled autograd keeps at least two [tokens, intermediate] tensors (the pre-activation and the
        # activation's output; SwiGLU keeps four); the generic recompute keeps a shard's worth of them
        # (so one shard saves nothing), for its extra buffers. Tile only where that pays. (The fast path
        # saves no intermediate at all, so even one shard lowers its peak.)
        saved = GENERIC_SAVED_INTERMEDIATES * intermediate_bytes * (1 - 1 / num_shards)
        extra = size.generic_trainable_bytes + 2 * math.ceil(num_tokens / num_shards) * size.hidden * size.element_bytes
        if saved <= extra:
            return None
    return num_shards
