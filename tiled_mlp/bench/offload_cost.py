"""What checkpoint offload costs: a stack of checkpointed Llama decoder layers (``checkpointed.LlamaLayer``,
each with our tiled MLP), one training step with and without the offload, rounds interleaved, the
median of each as a ratio. Also the host bytes it held and the device bytes it freed (every layer's
input but the last: ``(layers - 1) * tokens * hidden * element size``)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from tiled_mlp.core import TiledMLP
from tiled_mlp.core.checkpoint_offload import CheckpointOffload

from .checkpointed import Checkpointed, LlamaLayer


@dataclass
class OffloadCost:
    layers: int
    seq: int
    hidden: int
    plain_s: float
    offload_s: float
    host_peak_bytes: int
    rounds: int

    @property
    def ratio(self) -> float:
        return self.offload_s / self.plain_s


def llama_stack(layers: int, hidden: int, intermediate: int, heads: int, dtype: torch.dtype) -> nn.Sequential:
    """``layers`` checkpointed Llama decoder layers, each with our tiled MLP (seeded weights)."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        inner = LlamaLayer(hidden, intermediate, dtype, heads)
        TiledMLP(inner.mlp)
        blocks.append(Checkpointed(inner))
    return nn.Sequential(*blocks)


def _step(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).float().square().mean().backward()
    return time.perf_counter() - start


def measure(layers: int = 4, seq: int = 8192, hidden: int = 1024, intermediate: int = 2816, heads: int = 8,
            rounds: int = 5, dtype: torch.dtype = torch.float32,
            progress: Optional[Callable[[str], None]] = None) -> OffloadCost:
    model = llama_stack(layers, hidden, intermediate, heads, dtype)
    offload = CheckpointOffload(list(model))
    offload.remove()  # installed only for the offloaded steps
    x = torch.randn(1, seq, hidden, dtype=dtype, requires_grad=True)
    times: dict = {"plain": [], "offload": []}
    peak = 0
    for index in range(rounds + 1):  # round 0 warms up
        order = ("plain", "offload") if index % 2 else ("offload", "plain")
        for kind in order:
            handle = CheckpointOffload(list(model)) if kind == "offload" else None
            model.zero_grad(set_to_none=True)
            elapsed = _step(model, x)
            if handle is not None:
                peak = max(peak, handle.host_bytes.peak)
                handle.remove()
            if index:
                times[kind].append(elapsed)
        if progress is not None:
            progress(f"round {index}/{rounds}")
    return OffloadCost(layers, seq, hidden, statistics.median(times["plain"]), statistics.median(times["offload"]),
                       peak, rounds)


def format_cost(cost: OffloadCost) -> List[str]:
    return [
        f"{cost.layers} checkpointed Llama layers (tiled MLP), {cost.seq} tokens, hidden {cost.hidden}, fp32, CPU; "
        f"median of {cost.rounds} interleaved rounds",
        "| step | s (median) | vs without |",
        "|---|---|---|",
        f"| without offload | {cost.plain_s:.3f} | 1.000 |",
        f"| with offload | {cost.offload_s:.3f} | {cost.ratio:.3f} |",
        f"host memory held: {cost.host_peak_bytes:,} bytes ({cost.host_peak_bytes / 2**20:.1f} MiB; the inputs of layers 1..{cost.layers - 1}; "
        "the last layer's stays on the device)",
    ]
