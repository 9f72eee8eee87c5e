"""How the tokens of one call are split into shards. Every rank computes its own plan: nothing in the tiled
path issues a collective per shard, so ranks that pick different shard counts cannot deadlock.
"""
from __future__ import annotations

import functools
import itertools
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Union

NumShards = Union[int, str]
AUTO = "auto"  # resolved to a count (or to "run untiled") by ``auto_shards.auto_num_shards``


@dataclass(frozen=True)
class ShardPlan:
    """Token shards of one call: ``shard_sizes[i]`` tokens in ``slice_tuple[i]``, computed once."""

    num_tokens: int
    shard_sizes: tuple
    num_shards: int = field(init=False, compare=False)
    slice_tuple: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        starts = tuple(itertools.accumulate(self.shard_sizes[:-1], initial=0))
        object.__setattr__(self, "num_shards", len(self.shard_sizes))
        object.__setattr__(self, "slice_tuple", tuple(slice(start, start + size)
                                                      for start, size in zip(starts, self.shard_sizes, strict=True)))

    def slices(self):
        return iter(self.slice_tuple)


def check_num_shards(num_shards: NumShards) -> None:
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


def parse_num_shards(value: Any) -> NumShards:
    """A shard count from user input (CLI flags, a YAML/JSON config): "auto" in any case, an int >= 1 or a
    string of one; floats are refused even where whole."""
    expected = "num_shards must be 'auto' or an integer >= 1"
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{expected}, got {value!r}") from None
            raise ValueError(f"{expected}, got {value!r}: {_whole_number_fix(number)}")
        value = int(text)
    elif isinstance(value, bool):
        raise TypeError(f"{expected}, got bool {value!r}: to turn tiling on or off use the use_tiled_mlp flag")
    elif isinstance(value, float):
        raise TypeError(f"{expected}, got float {value!r}: {_whole_number_fix(value)}")
    elif isinstance(value, numbers.Integral):
        value = int(value)  # numpy integers and the like
    else:
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"num_shards must be >= 1 (1 means untiled work in one shard) or 'auto', got {value}")
    return value


def _whole_number_fix(value: float) -> str:
    if not math.isfinite(value) or value < 1:
        return "a shard count is a whole number; pass an int >= 1"
    if value.is_integer():
        return f"a shard count is a whole number; pass the int {int(value)}"
    return f"a shard count is a whole number; pass an int such as {math.floor(value)} or {math.ceil(value)}"


def split_evenly(num_tokens: int, num_shards: int) -> tuple:
    """Nearly equal shard sizes. No tokens is one empty shard, not none: a backend that gathers inside the
    tiled call (ZeRO-3) issues the same collectives as on a rank with tokens."""
    if num_tokens <= 0:
        return (0,)
    num_shards = min(num_shards, num_tokens)
    base, extra = divmod(num_tokens, num_shards)
    return tuple(base + 1 if i < extra else base for i in range(num_shards))


def make_shard_plan(num_tokens: int, num_shards: int) -> ShardPlan:
    check_num_shards(num_shards)
    if num_shards == AUTO:
        raise ValueError("make_shard_plan needs a shard count: resolve num_shards='auto' with auto_shards.auto_num_shards")
    return _plan(num_tokens, num_shards)


@functools.lru_cache(maxsize=1024)
def _plan(num_tokens: int, num_shards: int) -> ShardPlan:
    # Cached after the checks above (a cache would answer ``True`` as ``1``): a plan is immutable.
    return ShardPlan(num_tokens=num_tokens, shard_sizes=split_evenly(num_tokens, num_shards))
