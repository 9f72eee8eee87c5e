"""Input checks made before any work, so a bad call changes no state."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# Names that common MLPs give their first projection (Llama, Phi3, GPT-2, GPT-NeoX, Mixtral experts, ...).
INPUT_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc", "w1", "dense_h_to_4h", "fc_in")


def expected_hidden_size(module: nn.Module) -> Optional[int]:
    """The input feature count the module needs, when it can be known without running it: not where the
    projection's weight is distributed (a DTensor, read through its ``placements``), whose own hooks decide what
    input it takes (``ColwiseParallel(input_layouts=Shard(-1))`` takes each rank's slice of ``in_features``)."""
    candidates = [module] if isinstance(module, nn.Linear) else (getattr(module, name, None) for name in INPUT_PROJECTIONS)
    projection = next((c for c in candidates if isinstance(getattr(c, "in_features", None), int)), None)
    weight = getattr(projection, "_parameters", {}).get("weight")
    if projection is None or getattr(weight, "placements", None) is not None:
        return None
    return projection.in_features


def check_input(x, module: Optional[nn.Module]) -> None:
    """``module``: the module whose input size to check, or None where the input is not its own."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"TiledMLP expects a tensor input, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(
            f"TiledMLP expects an input of shape [..., tokens, hidden] (2 dims or more), got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        raise TypeError(f"TiledMLP expects a floating-point input, got dtype {x.dtype}; cast it first")
    hidden = expected_hidden_size(module) if module is not None else None
    if hidden is not None and x.shape[-1] != hidden:
        raise ValueError(
            f"TiledMLP input has hidden size {x.shape[-1]} but the wrapped {type(module).__name__} expects {hidden} "
            f"(input shape {tuple(x.shape)}); pass [..., tokens, {hidden}]"
        )
