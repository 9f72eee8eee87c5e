"""Per-shard kernel for a proven RMSNorm (``norm_forms``): the registered body's own operations, in its own
dtypes (``NormLayout``: the formula's plain values), so a shard's rows are bit for bit the module's. Backward recomputes the shard with autograd over the
same sequence for the input gradient; the weight gradient is the sum over the shard's tokens of ``dy *
normed`` (in the dtype the body multiplies in), summed in the ``GradAccumulator``'s dtype, never rounded to a
bf16 weight per shard. A constant offset (Gemma's ``1 + w``) has no gradient of its own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch

from .base import ShardKernel

if TYPE_CHECKING:
    from ..sharded_autograd import GradAccumulator

WEIGHT = 0  # the weight's index among the kernel's tensors (its only one)
MULTIPLY_IN_INPUT_DTYPE = "input_dtype"  # ``weight * normed.to(input_dtype)``: the output in promote(w, x)
MULTIPLY_IN_FLOAT32 = "float32"  # ``(normed * weight.float()).type_as(x)``: the output in x's dtype
MULTIPLIES = (MULTIPLY_IN_INPUT_DTYPE, MULTIPLY_IN_FLOAT32)


@dataclass(frozen=True)
class NormLayout:
    """The formula's plain values (a custom op carries them as arguments, ``ops/map_ops.py``)."""

    eps: float
    offset: float = 0.0
    multiply: str = MULTIPLY_IN_INPUT_DTYPE

    def __post_init__(self) -> None:
        if self.multiply not in MULTIPLIES:
            raise ValueError(f"a norm multiplies in one of {MULTIPLIES}, got {self.multiply!r}")

    def output_dtype(self, x_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
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
    """Autograd records the recompute, wherever the kernel runs. A custom op's implementation runs below
    autograd, its dispatcher excluding the autograd keys, so ``enable_grad`` alone records nothing there:
    they are let in again for the shard (everything else excluded, autocast, stays excluded)."""
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
    """The body reads the input, the weight and a float (proven by its code) and draws no random numbers."""

    name = "norm"
    replays_rng = False
    serves_many_calls = True

    def __init__(self, layout: NormLayout, weight: torch.Tensor, module_name: str = "the RMSNorm"):
        self.layout = layout
        self.params = [weight]
        self.owned_params = self.params  # the structure proved it owns nothing else
        self.module_name = module_name

    def _scale(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the normed rows: ``offset + w`` in the body's dtype."""
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
        dx = None
        with _recording():
            x = x_shard.detach().requires_grad_(grad_in_shard is not None)
            normed = _normed(x, self.layout.eps)
            if grad_in_shard is not None:
                y = self._output(normed, x.dtype, self._scale(tensors[WEIGHT].detach()))
                (dx,) = torch.autograd.grad(y, x, grad_out_shard)
                del y
        if grads.needed[WEIGHT]:
            normed = normed.detach()
            accum = grads.dtype_for(WEIGHT)
            if self.layout.multiply == MULTIPLY_IN_INPUT_DTYPE:
                # d(scale) = dy * normed.to(x.dtype): the cast's rounding is the body's, product and sum in ``accum``.
                per_token = grad_out_shard.to(accum) * normed.to(x_shard.dtype).to(accum)
            else:
                # y = (normed * scale).to(x.dtype): autograd's grad of the product is dy.to(float32) * normed.
                per_token = (grad_out_shard.to(torch.float32) * normed).to(accum)
            grads.add(WEIGHT, per_token.sum(0))
        return dx
