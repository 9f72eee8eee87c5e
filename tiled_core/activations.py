"""Gated activation kernels behind one small interface.

``forward_mul(g, u)`` returns ``act(g) * u``; ``backward_mul(dh, g, u)`` returns ``(dg, du)`` and may
overwrite ``g``, ``u`` and ``dh`` (the caller no longer needs them), which keeps a shard's working set
to a few ``[tokens, intermediate]`` buffers.

The native kernels use aten's fused ``*_backward`` ops, which run on CPU, CUDA and Ascend NPU alike.
Nothing here imports torch_npu: torch ops dispatch to it when the tensors live on an NPU. A faster
kernel for a device type (a Triton kernel on CUDA) is registered by whoever knows its library
(``register_fused_kernel``), and used when the call allows it and the library is installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Iterable, List, Tuple

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


@dataclass(frozen=True)
class FusedKernel:
    """A faster kernel for some activations on one device type: ``factory(name)`` builds it, when
    ``available()`` (its library is installed)."""

    device_type: str
    names: FrozenSet[str]
    factory: Callable[[str], Any]
    available: Callable[[], bool]


# Registered fused kernels (``register_fused_kernel``); the last registered for a device and name wins.
_FUSED: List[FusedKernel] = []
_FUSED_GENERATION = [0]


def fused_generation() -> int:
    return _FUSED_GENERATION[0]


def register_fused_kernel(device_type: str, names: Iterable[str], factory: Callable[[str], Any],
                          available: Callable[[], bool] = lambda: True) -> FusedKernel:
    """Use ``factory(name)`` (an object with ``forward_mul`` and ``backward_mul`` as
    ``NativeGatedActivation``'s) for the activations ``names`` on tensors of ``device_type``, whenever
    ``available()``; each call that takes the gated fast kernel with fused kernels allowed asks."""
    names = frozenset(names)
    unknown = sorted(names - set(ACTIVATIONS))
    if unknown or not names:
        raise ValueError(f"a fused kernel computes some of {', '.join(ACTIVATIONS)}; got {sorted(names)}")
    if not isinstance(device_type, str) or not callable(factory) or not callable(available):
        raise TypeError("register_fused_kernel takes a device type name, the activation names, a factory and "
                        "an availability check")
    kernel = FusedKernel(device_type, names, factory, available)
    _FUSED.append(kernel)
    _FUSED_GENERATION[0] += 1
    return kernel


def unregister_fused_kernel(kernel: FusedKernel) -> None:
    """Withdraw what ``register_fused_kernel`` returned."""
    _FUSED[:] = [k for k in _FUSED if k is not kernel]
    _FUSED_GENERATION[0] += 1


def gated_activation(name: str, device: torch.device, use_fused: bool = True):
    """The kernel for ``name`` on ``device``: the last fused kernel registered for it and available,
    when ``use_fused``, else the native one."""
    if use_fused:
        for kernel in reversed(_FUSED):
            if kernel.device_type == device.type and name in kernel.names and kernel.available():
                return kernel.factory(name)
    return NativeGatedActivation(name)
