"""Per-shard kernel for a proven RMSNorm (``norm_forms``): the registered body's own operations, in its
own dtypes, on one token shard.

Forward runs the same op sequence as the body (a cast to float32, ``pow(2).mean(-1, keepdim=True)``,
``+ eps``, ``rsqrt``, the products and casts of its ``multiply``), so a shard's rows are bit for bit the
module's. Backward recomputes the shard with autograd over that same sequence for the input gradient,
which is then bit for bit autograd's through the module. The weight gradient is the sum over the shard's
tokens of its per-token product (``dy * normed``, in the dtype the body multiplies in), summed in the
``GradAccumulator``'s dtype (float32 at least for a tiled norm: ``NORM_ACCUM_DTYPE``), never rounded to a
bf16 weight per shard. A constant offset (Gemma's ``1 + w``) has no gradient of its own.

Everything the kernel needs is plain values (``NormLayout``), so a custom op carries it as arguments
(``ops/rms_norm.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from ..norm_forms import MULTIPLIES, MULTIPLY_IN_INPUT_DTYPE, NormSpec
from .base import ShardKernel

if TYPE_CHECKING:
    from ..sharded_autograd import GradAccumulator

WEIGHT = 0  # the weight's index among the kernel's tensors (its only one)


@dataclass(frozen=True)
class NormLayout:
    """The formula's plain values: eps, the offset added to the weight, the dtype the weight multiplies in."""

    eps: float
    offset: float = 0.0
    multiply: str = MULTIPLY_IN_INPUT_DTYPE

    def __post_init__(self) -> None:
        if self.multiply not in MULTIPLIES:
            raise ValueError(f"a norm multiplies in one of {MULTIPLIES}, got {self.multiply!r}")

    @classmethod
    def of(cls, spec: NormSpec) -> NormLayout:
        return cls(spec.eps, spec.offset, spec.multiply)

    def output_dtype(self, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
        """``weight * normed.to(x.dtype)`` is in the promoted dtype; ``(...).type_as(x)`` in x's."""
        return torch.promote_types(weight_dtype, x_dtype) if self.multiply == MULTIPLY_IN_INPUT_DTYPE else x_dtype


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)`` for ``h = x.to(float32)``: the bodies' sequence."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return h * torch.rsqrt(variance + eps)


_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in ("AutogradCPU", "AutogradOther",
                                                                        "AutogradNestedTensor"))


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Autograd records the recompute, wherever the kernel runs. A custom op's implementation
    (``ops/rms_norm.py``) runs below autograd: its dispatcher excludes the autograd keys, so that
    ``enable_grad`` alone records nothing there. They are let in again for the shard (removing one
    per-backend autograd key removes autograd's functionality for every backend); everything else
    excluded (autocast) stays excluded. In the eager Function's backward nothing is excluded: a no-op."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    if not any(exclude.has(key) for key in _AUTOGRAD_KEYS):
        with torch.enable_grad():
            yield
        return
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


class RMSNormShardKernel(ShardKernel):
    """The body reads the input, the weight and a float (proven by its code) and draws no random numbers.
    Declined for distributed parameters (``builtin_kernels.NormEntry``): the generic kernel runs those."""

    name = "norm"
    replays_rng = False
    serves_many_calls = True  # stateless: one per call plan

    def __init__(self, layout: NormLayout, weight: torch.Tensor, module_name: str = "the RMSNorm"):
        self.layout = layout
        self.params = [weight]
        self.owned_params = self.params  # the structure proved it owns nothing else
        self.module_name = module_name

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the normed rows: ``offset + w`` in the body's dtype (``w`` itself without offset)."""
        layout = self.layout
        w = weight.float() if layout.multiply != MULTIPLY_IN_INPUT_DTYPE else weight
        return w if layout.offset == 0.0 else layout.offset + w

    def _output(self, normed: torch.Tensor, x_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
        if self.layout.multiply == MULTIPLY_IN_INPUT_DTYPE:
            return scale * normed.to(x_dtype)
        return (normed * scale).to(x_dtype)

    def forward_shard(self, x_shard: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self._output(_normed(x_shard, self.layout.eps), x_shard.dtype, self._scale(tensors[WEIGHT]))

    def backward_into(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, grad_in_shard: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                      shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        weight = tensors[WEIGHT].detach()
        need_dw = grads.needed[WEIGHT]
        dx = None
        with _recording():
            x = x_shard.detach().requires_grad_(grad_in_shard is not None)
            normed = _normed(x, self.layout.eps)
            if grad_in_shard is not None:
                y = self._output(normed, x.dtype, self._scale(weight))
                (dx,) = torch.autograd.grad(y, x, grad_out_shard)
                del y
        if need_dw:
            self._add_weight_grad(x_shard, grad_out_shard, normed.detach(), grads)
        return dx

    def _add_weight_grad(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, normed: torch.Tensor,
                         grads: GradAccumulator) -> None:
        accum = grads.dtype_for(WEIGHT)
        if self.layout.multiply == MULTIPLY_IN_INPUT_DTYPE:
            # d(scale) = dy * normed.to(x.dtype): the rounding of the cast is the body's, the product and the
            # sum in the accumulation dtype.
            per_token = grad_out_shard.to(accum) * normed.to(x_shard.dtype).to(accum)
        else:
            # y = (normed * scale).to(x.dtype): autograd's grad of the product is dy.to(float32) * normed.
            per_token = (grad_out_shard.to(torch.float32) * normed).to(accum)
        grads.add(WEIGHT, per_token.sum(0))
