"""Gated activation kernels behind one small interface.

``forward_mul(g, u)`` returns ``act(g) * u``; ``backward_mul(dh, g, u)`` returns ``(dg, du)`` and may
overwrite ``g``, ``u`` and ``dh`` (the caller no longer needs them), which keeps a shard's working set
to a few ``[tokens, intermediate]`` buffers.

The native kernels use aten's fused ``*_backward`` ops, which run on CPU, CUDA and Ascend NPU alike.
On CUDA, Liger-Kernel's Triton SiLU-mul / GELU(tanh)-mul kernels are used when liger-kernel is
installed. Nothing here imports torch_npu: torch ops dispatch to it when the tensors live on an NPU.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Tuple

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class NativeGatedActivation:
    """Pure-torch kernels (every device type)."""

    def __init__(self, name: str):
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown gated activation {name!r}; known: {', '.join(ACTIVATIONS)}")
        self.name = name

    def act(self, g: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return F.silu(g)
        return F.gelu(g, approximate="tanh" if self.name == "gelu_tanh" else "none")

    def act_backward(self, grad: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = grad * act'(g)``; ``out`` may be ``g`` itself (same-index elementwise aliasing)."""
        if self.name == "silu":
            return torch.ops.aten.silu_backward.grad_input(grad, g, grad_input=out)
        approximate = "tanh" if self.name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward.grad_input(grad, g, approximate=approximate, grad_input=out)

    def forward_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.act(g).mul_(u)

    def backward_mul(self, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        du = self.act(g).mul_(dh)  # du = dh * act(g)
        dh.mul_(u)  # dh * u: the upstream gradient of act(g)
        dg = self.act_backward(dh, g, out=g)
        return dg, du


class LigerGatedActivation:
    """Liger-Kernel's Triton SiLU-mul and GELU(tanh)-mul (CUDA only); both write gradients in place."""

    def __init__(self, name: str):
        if name == "silu":
            from liger_kernel.ops.swiglu import swiglu_backward, swiglu_forward

            self._forward, self._backward = swiglu_forward, swiglu_backward
        elif name == "gelu_tanh":
            from liger_kernel.ops.geglu import geglu_backward, geglu_forward

            self._forward, self._backward = geglu_forward, geglu_backward
        else:
            raise ValueError(f"Liger has no gated kernel for {name!r}")
        self.name = name

        # Liger's kernels step every operand by the output's row stride: they need contiguous rows,
        # which the views of a fused gate_up buffer are not.
        self._native = NativeGatedActivation(name)

    def forward_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if not (g.is_contiguous() and u.is_contiguous()):
            return self._native.forward_mul(g, u)
        return self._forward(g, u)[2]

    def backward_mul(self, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if not (g.is_contiguous() and u.is_contiguous() and dh.is_contiguous()):
            return self._native.backward_mul(dh, g, u)
        dg, du = self._backward(g, u, dh)
        return dg, du


@functools.cache
def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def gated_activation(name: str, device: torch.device, use_liger: bool = True):
    """The fastest kernel for ``name`` on ``device``: Liger's on CUDA when installed, else native."""
    if use_liger and device.type == "cuda" and name in ("silu", "gelu_tanh") and liger_available():
        return LigerGatedActivation(name)
    return NativeGatedActivation(name)
