"""How many token shards the tiled loss uses. A shard holds about two float32 ``[shard, vocab]`` buffers at the
peak (its logits, which become their gradient in place, and the head-dtype logits while they are upcast):
``LOSS_SHARD_BYTES`` keeps that pair at 512 MiB, under torch's chunked ``F.linear_cross_entropy`` (``tiled-mlp
bench-loss``), while a shard is still 2048 tokens at a 32K vocabulary, matmuls large enough to run at full speed.
"""
from __future__ import annotations

import math

from .shard_plan import AUTO, NumShards

LOSS_SHARD_BYTES = 256 * 2**20
LOSS_ELEMENT_BYTES = 4  # float32 loss math


def loss_num_shards(num_tokens: int, vocab: int, num_shards: NumShards = AUTO) -> int:
    """The configured count (checked by the caller), or enough shards that one shard's float32 logits fit
    ``LOSS_SHARD_BYTES``."""
    if num_shards != AUTO:
        return int(num_shards)
    shard_tokens = max(1, LOSS_SHARD_BYTES // (max(1, vocab) * LOSS_ELEMENT_BYTES))
    return max(1, math.ceil(num_tokens / shard_tokens))
