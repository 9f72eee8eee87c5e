"""What the float64 distributed comparisons (the tiled loss, checkpoint offload, Ulysses SP, TP) share: their
bounds, the relative error they hold to them, whole tensors from sharded ones, and the mark for DeepSpeed's
cases."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

# float64 end to end (DDP, FSDP2, one device): the tiled runs sum the same products in another order
# (shards, the all-reduce of two ranks), a few float64 ulps (measured worst 8.4e-16).
BOUND = 1e-12
# DeepSpeed engines train a float32 model, compared with the float64 reference. ZeRO-3's ``zero.Init``
# accepts half, bfloat16 and float32 parameters only, and whether a float64 module reaches that assertion
# depends on the CPU: DeepSpeed 0.19's ``Init._set_dtype`` keeps the module's dtype where its CPU
# accelerator reports fp16 support (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 / AMX-FP16
# parts) and silently takes bfloat16 as the dtype elsewhere, so a float64 engine runs on one machine and
# asserts on the next. ZeRO keeps float32 master partitions anyway.
ZERO_DTYPE = torch.float32
# The float32 engine against the float64 reference: float32 rounding in every matmul, softmax and
# reduction (forward, backward, the gradient reduction, the float32 SGD steps), the untiled engine's as much
# as the tiled one's. Measured worst: 8.4e-7 in the offload harness (its untiled ZeRO-3 control), 5.7e-7 in
# the tiled-loss harness (its untiled ZeRO-3 case), 1.3e-6 under SP (ZeRO-2, Qwen2, a step-1 gradient).
# A wrong gradient (a shard dropped or delivered twice, a gradient not scaled by the incoming one, a rank's
# share missing or doubled) is off by 1e-3 or more.
ZERO_BOUND = 5e-6
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (an optional extra)")


def rel_error(want: torch.Tensor, have: torch.Tensor) -> float:
    """max |have - want| / max |want|, in float64 (inf where the shapes differ)."""
    if want.shape != have.shape:
        return float("inf")
    want, have = want.double(), have.double()
    return float((have - want).abs().max() / want.abs().max().clamp_min(1e-30))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor; of a DTensor, ``full_tensor()`` (a collective: every rank calls
    it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _float_kept(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.requires_grad and tensor.is_floating_point():
        return tensor
    return tensor.to(torch.float32)


def float_kept_float64() -> Any:
    """A float64 reference through Hugging Face's own code: its ``.float()`` calls keep what autograd
    tracks (the loss's ``logits.float()``: a float64 model's loss stays float64) and cast the rest as torch
    does (RoPE's frequencies and positions: float32, as in the model under test, whichever of the two
    transformers releases puts ``.float()`` on)."""
    from unittest import mock

    return mock.patch.object(torch.Tensor, "float", _float_kept)
