"""What tiling the RMSNorms costs and saves (``tiled-mlp bench-norms``): a stack of checkpointed Llama
decoder layers (``offload_cost.llama_stack``, tiled MLPs), one training step with Hugging Face's
``LlamaRMSNorm`` as it is and one with each layer's two norms tiled as ``apply_tiled_mlp(norms=True)``
tiles them (generic path, weight gradients summed in float32). Exact peak memory of each step (the
live-storage tracker), time as the median of interleaved rounds and its ratio, and the largest relative
difference of the output and every gradient.

The saving is the float32 upcast: in bfloat16 (the default) Hugging Face's norm keeps float32
``[tokens, hidden]`` tensors, in float32 its upcast is the tensor itself.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from tiled_mlp.core import TiledMLP

from .measure import max_relative_error, peak_bytes, step_outputs, step_seconds
from .offload_cost import llama_stack

NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass
class NormCost:
    layers: int
    seq: int
    hidden: int
    dtype: torch.dtype
    plain_s: float
    tiled_s: float
    plain_peak: int
    tiled_peak: int
    rounds: int
    difference: float  # the largest relative difference over the output, the input's and every weight's gradient

    @property
    def ratio(self) -> float:
        return self.tiled_s / self.plain_s


def tile_norms(stack: nn.Sequential) -> List[nn.Module]:
    """Each layer's two norms, tiled in place as ``norms=True`` does; returns them."""
    norms = [norm for module in stack.modules() for name in NORMS
             if isinstance(norm := getattr(module, name, None), nn.Module)]  # the decoder layers' own
    for norm in norms:
        TiledMLP(norm, path="generic", grad_accum_dtype=torch.float32)
    return norms


def measure(layers: int = 4, seq: int = 8192, hidden: int = 1024, intermediate: int = 2816, heads: int = 8,
            rounds: int = 5, dtype: torch.dtype = torch.bfloat16,
            progress: Optional[Callable[[str], None]] = None) -> NormCost:
    plain = llama_stack(layers, hidden, intermediate, heads, dtype)
    tiled = copy.deepcopy(plain)
    tile_norms(tiled)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, hidden, generator=generator).to(dtype).requires_grad_(True)
    dy = torch.randn(1, seq, hidden, generator=generator).to(dtype)
    peaks = [peak_bytes(model, model, x, dy) for model in (plain, tiled)]
    difference = max_relative_error(step_outputs(tiled, tiled, x, dy), step_outputs(plain, plain, x, dy))
    both = nn.ModuleList([plain, tiled])  # zeroed together before every step
    seconds = step_seconds({"plain": plain, "tiled": tiled}, both, x, dy, repeats=rounds, warmup=1,
                           on_round=None if progress is None else lambda r: progress(f"round {r + 1}/{rounds}"))
    return NormCost(layers, seq, hidden, dtype, seconds["plain"], seconds["tiled"], peaks[0], peaks[1], rounds,
                    difference)


def format_cost(cost: NormCost) -> List[str]:
    dtype = str(cost.dtype).replace("torch.", "")
    mib = 2**20
    return [
        f"{cost.layers} checkpointed Llama layers (tiled MLP), {cost.seq} tokens, hidden {cost.hidden}, {dtype}, CPU; "
        f"time: median of {cost.rounds} interleaved rounds; peak: exact (live storages)",
        "| norms | s (median) | vs HF's | peak MiB | vs HF's |",
        "|---|---|---|---|---|",
        f"| Hugging Face's LlamaRMSNorm | {cost.plain_s:.3f} | 1.000 | {cost.plain_peak / mib:.1f} | 1.000 |",
        f"| tiled (norms=True) | {cost.tiled_s:.3f} | {cost.ratio:.3f} | {cost.tiled_peak / mib:.1f} | "
        f"{cost.tiled_peak / cost.plain_peak:.3f} |",
        f"largest relative difference, output and every gradient: {cost.difference:.1e}",
    ]
