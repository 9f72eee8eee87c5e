"""The "auto" shard policy, derived from the fake-tensor memory model (see README, "Auto policy").

Two rules, both cheap enough for every forward:

1. **Shard size**: enough shards that one shard's ``[tokens, intermediate]`` buffer holds about
   ``SHARD_INTERMEDIATE_BYTES``. The modelled peak falls as shards shrink and flattens out near the
   floor that no tiling removes (input, output, their gradients, weights and weight gradients);
   64 MiB per buffer sits on the flat part (at 131072 tokens, hidden 4096, intermediate 12288, bf16:
   48 shards, 0.225 of untiled against 0.216 for 256 shards), while a shard is still ~2700 tokens,
   large enough to keep a GPU's matrix units busy.
2. **Pass-through**: tiling costs recompute (11 matmul units against 9) and some fixed buffers, so it
   only pays when the intermediates it stops keeping are a real share of the step's memory. When the
   whole call's intermediate bytes are under ``MIN_INTERMEDIATE_SHARE`` of the fixed bytes, "auto"
   runs the module untiled: at 2048 tokens of the 4096/12288 model, tiling would save at most 4-9%
   of the peak for ~20% more time, and with one or two shards it raises the peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from torch import nn

SHARD_INTERMEDIATE_BYTES = 64 * 2**20
MIN_INTERMEDIATE_SHARE = 0.1

# The first projection of common MLPs, whose output width is the intermediate size.
_INPUT_PROJECTIONS = ("gate_proj", "up_proj", "fc1", "c_fc", "w1", "dense_h_to_4h", "fc_in")


@dataclass(frozen=True)
class MLPSize:
    """What the policy needs to know about a module, read without running it."""

    hidden: int
    intermediate: Optional[int]  # None: unknown (the policy falls back to ~hidden tokens per shard)
    weight_bytes: int
    element_bytes: int


def intermediate_size(module: nn.Module) -> Optional[int]:
    fused = getattr(module, "gate_up_proj", None)
    if isinstance(getattr(fused, "out_features", None), int):
        return fused.out_features // 2
    for name in _INPUT_PROJECTIONS:
        out_features = getattr(getattr(module, name, None), "out_features", None)
        if isinstance(out_features, int):
            return out_features
    return None


def mlp_size(module: nn.Module, hidden: int, element_bytes: int) -> MLPSize:
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return MLPSize(hidden, intermediate_size(module), weight_bytes, element_bytes)


def auto_num_shards(num_tokens: int, size: MLPSize) -> Optional[int]:
    """The shard count for ``num_tokens`` tokens, or None to run the module untiled."""
    if size.intermediate is None:
        return max(1, math.ceil(num_tokens / max(1, size.hidden)))
    intermediate_bytes = num_tokens * size.intermediate * size.element_bytes
    # Weights and their grads, plus input, output and both of their grads.
    fixed_bytes = 2 * size.weight_bytes + 4 * num_tokens * size.hidden * size.element_bytes
    if intermediate_bytes < MIN_INTERMEDIATE_SHARE * fixed_bytes:
        return None
    tokens_per_shard = max(1, SHARD_INTERMEDIATE_BYTES // (size.intermediate * size.element_bytes))
    return max(1, math.ceil(num_tokens / tokens_per_shard))
