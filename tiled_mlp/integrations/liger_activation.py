"""Liger-Kernel's Triton SiLU-mul and GELU(tanh)-mul, registered as the fused gated kernels on CUDA where
liger-kernel is installed (imported at the first such call)."""
from __future__ import annotations

import functools
import importlib.util
from typing import Tuple

import torch

from tiled_mlp.core.kernels.gated import NativeGatedActivation, register_fused_kernel


class LigerGatedActivation(NativeGatedActivation):
    """Liger's kernels step every operand by the output's row stride: they need contiguous rows, which the
    views of a fused gate_up buffer are not (those take the native kernels)."""

    def __init__(self, name: str):
        super().__init__(name)
        if name == "silu":
            from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward

            self._forward, self._backward = swiglu_forward, swiglu_backward
        else:  # registered for silu and gelu_tanh only
            from liger_kernel.ops.geglu import geglu_backward, geglu_forward

            self._forward, self._backward = geglu_forward, geglu_backward

    def forward_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if not (g.is_contiguous() and u.is_contiguous()):
            return super().forward_mul(g, u)
        return self._forward(g, u)[2]

    def backward_mul(self, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if not (g.is_contiguous() and u.is_contiguous() and dh.is_contiguous()):
            return super().backward_mul(dh, g, u)
        dg, du = self._backward(g, u, dh)
        return dg, du


@functools.cache
def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


LIGER_KERNEL = register_fused_kernel("cuda", ("silu", "gelu_tanh"), LigerGatedActivation, liger_available)
