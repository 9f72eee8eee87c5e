"""How the tokens of one call are split into shards.

The plan is computed before any work is done, so a bad ``num_shards`` fails with no state changed.
Every rank computes its own plan: nothing in the tiled path issues a collective per shard, so ranks
that see different token counts (and so pick different shard counts) cannot deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

NumShards = Union[int, str]
AUTO = "auto"  # resolved to a count (or to "run untiled") by ``auto_shards.auto_num_shards``


@dataclass(frozen=True)
class ShardPlan:
    """Token shards of one call: ``shard_sizes[i]`` tokens starting at ``offsets[i]``."""

    num_tokens: int
    shard_sizes: tuple

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    @property
    def offsets(self) -> tuple:
        starts, total = [], 0
        for size in self.shard_sizes:
            starts.append(total)
            total += size
        return tuple(starts)

    def slices(self):
        for start, size in zip(self.offsets, self.shard_sizes):
            yield slice(start, start + size)


def check_num_shards(num_shards: NumShards) -> None:
    """Reject anything that is not an int >= 1 or "auto", naming the fix."""
    if isinstance(num_shards, str):
        if num_shards != AUTO:
            raise ValueError(f"num_shards must be an int >= 1 or 'auto', got the string {num_shards!r}")
        return
    if isinstance(num_shards, bool) or not isinstance(num_shards, int):
        raise TypeError(
            f"num_shards must be an int >= 1 or 'auto', got {type(num_shards).__name__} {num_shards!r}"
        )
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1 (1 means untiled work in one shard), got {num_shards}")


def split_evenly(num_tokens: int, num_shards: int) -> tuple:
    """Nearly equal shard sizes; more shards than tokens clamps to one token per shard.

    No tokens is one empty shard, not none: the kernel still runs once (on zero rows), so a backend
    that gathers inside the tiled call (ZeRO-3) issues the same collectives as on a rank with tokens.
    """
    if num_tokens <= 0:
        return (0,)
    num_shards = min(num_shards, num_tokens)
    base, extra = divmod(num_tokens, num_shards)
    return tuple(base + 1 if i < extra else base for i in range(num_shards))


def make_shard_plan(num_tokens: int, num_shards: int) -> ShardPlan:
    check_num_shards(num_shards)
    if num_shards == AUTO:
        raise ValueError("make_shard_plan needs a shard count: resolve num_shards='auto' with auto_shards.auto_num_shards")
    return ShardPlan(num_tokens=num_tokens, shard_sizes=split_evenly(num_tokens, num_shards))
