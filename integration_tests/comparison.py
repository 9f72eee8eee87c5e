"""What the float64 distributed comparisons (the tiled loss, checkpoint offload, Ulysses SP) share: their
bounds, the relative error they hold to them, and the mark for DeepSpeed's cases."""
from __future__ import annotations

import importlib.util

import pytest
import torch

# float64 end to end (DDP, FSDP2, one device): the tiled runs sum the same products in another order
# (shards, the all-reduce of two ranks), a few float64 ulps (measured worst 8.4e-16).
BOUND = 1e-12
# DeepSpeed: the float64 model computes in float64, but ZeRO's optimizers keep float32 master partitions
# (``.float()``): the full gradients come back in float32 (step 0: within 7.9e-8 of the float64
# reference, one or two float32 roundings), the SGD steps are taken in float32, and the second step's
# gradients inherit the first update's float32 rounding. Measured worst 1.3e-7 (a step-1 gradient; the
# untiled ZeRO-3 run shows the same). A wrong gradient (a shard dropped or delivered twice, a gradient
# not scaled by the incoming one, a rank's share missing) is off by 1e-2 or more.
ZERO_BOUND = 5e-7
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (an optional extra)")


def rel_error(want: torch.Tensor, have: torch.Tensor) -> float:
    """max |have - want| / max |want|, in float64 (inf where the shapes differ)."""
    if want.shape != have.shape:
        return float("inf")
    want, have = want.double(), have.double()
    return float((have - want).abs().max() / want.abs().max().clamp_min(1e-30))
