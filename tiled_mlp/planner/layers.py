"""The decoder layers of a built model: where they are, how many parameters each holds, and which
kinds there are (a Qwen3-MoE with ``decoder_sparse_step=2`` alternates MoE and dense layers; a
DeepSeek-V3 begins with ``first_k_dense_replace`` dense ones).

Read from the full-depth model itself, so that layers that differ are counted as they are.
"""
from __future__ import annotations

from collections import Counter
from typing import List

import torch
from torch import nn

from .backends import ZERO3_PERSISTENCE_THRESHOLD, ParamSizes
from .timeline import stored_in


def decoder_layers(model: nn.Module, count: int) -> nn.ModuleList:
    """The model's list of ``count`` decoder layers (the one with the most parameters, should there be
    several lists of that length); a ValueError when there is none."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no list of {count} decoder layers (num_hidden_layers)")
    return max(stacks, key=lambda stack: sum(p.numel() for p in stack.parameters()))


def _held(p: torch.Tensor) -> int:
    """The elements of ``p`` this rank holds: a DTensor's local shard under tensor parallelism."""
    return sum(t.numel() for t in stored_in(p))


def param_sizes(model: nn.Module, layers: nn.ModuleList) -> ParamSizes:
    total = sum(_held(p) for p in model.parameters())
    per_layer = [sum(_held(p) for p in layer.parameters()) for layer in layers]
    largest_module = max(sum(_held(p) for p in m.parameters(recurse=False)) for m in model.modules())
    persistent = sum(_held(p) for p in model.parameters() if _held(p) <= ZERO3_PERSISTENCE_THRESHOLD)
    return ParamSizes(total=total, largest_layer=max(per_layer), root=total - sum(per_layer),
                      largest_module=largest_module, persistent=persistent)


def _kind(layer: nn.Module) -> str:
    """A layer's kind: its class and its direct children's classes (an MoE block or a dense MLP)."""
    return " ".join([type(layer).__name__] + sorted({type(child).__name__ for child in layer.children()}))


def describe_kinds(layers: nn.ModuleList) -> str:
    """'' when every layer is alike; otherwise how many of each kind, named by what sets them apart."""
    kinds: List[str] = [_kind(layer) for layer in layers]
    counts = Counter(kinds)
    if len(counts) == 1:
        return ""
    shared = set.intersection(*(set(kind.split()) for kind in counts))
    named = [" + ".join(sorted(set(kind.split()) - shared)) or kind for kind in counts]
    return ", ".join(f"{counts[kind]} with {name}" for kind, name in zip(counts, named, strict=True))
