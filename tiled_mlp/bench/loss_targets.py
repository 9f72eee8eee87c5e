"""The targets the tiled loss is held to, checked against one run's measurements (fixed here, not tuned).

Memory (the full-size fake-tensor peak):
- ours, head-dtype accumulation: <= 1.05 x (x + dx + W + dW + one of our shards' float32 logits and their
  float32 gradient): the shard's working set is all it may add to the floor;
- ours, float32 accumulation: <= torch's chunked ``F.linear_cross_entropy`` (which accumulates in float32).
Time (CPU, float32, median of interleaved rounds):
- ours <= 1.05 x untiled, and <= 1.00 x torch's chunked path.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from .loss_memory import MemoryReference

GiB = 2**30


def _target(name: str, value: Optional[float], limit: Optional[float], unit: str) -> Dict[str, Any]:
    met = None if value is None or limit is None else value <= limit
    return dict(name=name, value=value, limit=limit, unit=unit, met=met)


def evaluate_targets(rows: Mapping[str, Mapping[str, Any]], reference: MemoryReference) -> List[Dict[str, Any]]:
    def peak(name):
        value = rows.get(name, {}).get("peak_bytes")
        return None if value is None else value / GiB

    def ratio(name):
        return rows.get(name, {}).get("time_ratio")

    torch_seconds = rows.get("torch", {}).get("seconds")
    ours_seconds = rows.get("ours", {}).get("seconds")
    return [
        _target("ours peak <= 1.05 x (floor + one shard's fp32 logits and gradient)", peak("ours"),
                1.05 * reference.floor_plus_shard / GiB, "GiB"),
        _target("ours (fp32 accum) peak <= torch chunked peak", peak("ours_fp32"), peak("torch"), "GiB"),
        _target("ours time <= 1.05 x untiled", ratio("ours"), 1.05, "x untiled"),
        _target("ours time <= 1.00 x torch chunked",
                None if torch_seconds is None or ours_seconds is None else ours_seconds / torch_seconds, 1.00,
                "x torch chunked"),
    ]
