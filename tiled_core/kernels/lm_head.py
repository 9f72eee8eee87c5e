"""Per-shard kernels of the tiled loss: an output head's logits, then ``cross_entropy.py``. The logits are in the
head's dtype, the loss in float32 or wider (``ForCausalLMLoss``'s ``logits.float()``).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..sharded_autograd import autocast_enabled
from ..tensor_reads import TensorReads, describe, next_sequence_nr
from .base import (
    ReduceKernel,
    Slots,
    Swapped,
    grads_via_stand_ins,
    hookless_stand_ins,
    parameter_slots,
    put_in_slots,
    restore_slots,
)
from .cross_entropy import CrossEntropyOptions, check_targets, cross_entropy_shard

if TYPE_CHECKING:
    from tiled_mlp.strategies.base import VocabSlice

    from ..sharded_autograd import GradAccumulator

HEAD_READ_ERROR = (
    "tiled loss: the head {head} read tensors that require grad besides its parameters ({tensors}); their "
    "gradients would be lost. Register them as parameters of the head."
)


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def is_plain_linear(head: nn.Module, is_backend_hook: Callable[[Any], bool] = lambda hook: False) -> bool:
    """``head`` computes ``F.linear`` with its weight and bias: no forward on the instance unless it is the
    backend's own (Hugging Face's tensor-parallel styles put one there, which the vocabulary slice stands in for),
    and no parametrization (its weight is computed from other tensors, which the module head trains)."""
    own = head.__dict__.get("forward")
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and (own is None or is_backend_hook(own)) and not parametrize.is_parametrized(head))


class LinearHeadKernel(ReduceKernel):
    """A plain ``nn.Linear`` head, its matmuls written out, so the only ``[tokens, vocab]`` buffers alive are the
    shard's logits and their gradient. Its rows may be this rank's slice of a vocabulary split over ranks
    (``split``): docs/backends.md, "The vocabulary-parallel tiled loss"."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], options: CrossEntropyOptions,
                 module_name: str = "the head", split: Optional[VocabSlice] = None):
        super().__init__([weight] if bias is None else [weight, bias], module_name)
        self.options = options
        # Only what the cross-entropy reads (the slice also holds the hidden states, which a kernel must not keep).
        self.split = None if split is None else (split.start, split.vocab_size, split.group)

    def compute_tensors(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        """The weight (and bias) cast once per call to autocast's dtype where autocast casts it."""
        device, dtype = x.device.type, tensors[0].dtype
        if autocast_enabled(device) and dtype in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.get_autocast_dtype(device)
        return tuple(t.to(dtype) for t in tensors)

    def shard(self, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, dx: Optional[torch.Tensor],
              grads: Optional[GradAccumulator], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        # Every matmul in ``compute_tensors``' dtype, with autocast off ("meta", the planner's, has none to turn off).
        weight, *rest = tensors
        bias = rest[0] if rest else None
        dtype = weight.dtype
        off = torch.autocast(x.device.type, enabled=False) if autocast_enabled(x.device.type) else contextlib.nullcontext()
        with off:
            x = x.to(dtype)
            logits = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
            wide = logits.to(loss_dtype(logits.dtype))  # a copy only where the loss dtype is wider
            del logits
            with_grad = dx is not None or (grads is not None and any(grads.needed))
            loss, grad = cross_entropy_shard(wide, targets, self.options, scale, with_grad, self.split)
            if grad is None:
                return loss
            low = grad.to(dtype)
            if dx is not None:
                torch.mm(low, weight, out=dx) if dx.dtype == dtype else dx.copy_(low @ weight)
            if grads is not None:
                # Summed in a wider dtype than the matmuls' (grad_accum_dtype=float32 for a bf16 head): the product
                # of the float32 gradient and input, never through a [vocab, hidden] temporary in the low dtype.
                wide_sum = grads.dtype_for(0) == grad.dtype != dtype
                rows, inputs = (grad, x.to(grad.dtype)) if wide_sum else (low, x)
                del low
                grads.add_matmul(0, rows.t(), inputs)
                if bias is not None:
                    grads.add_rowsum(1, rows)
        return loss


class ModuleHeadKernel(ReduceKernel):
    """Any other head (PEFT's LoRA ``lm_head``): its forward per shard, with a graph."""

    def __init__(self, head: nn.Module, trainable: Sequence[torch.Tensor], options: CrossEntropyOptions):
        super().__init__(trainable, type(head).__name__)
        self.head = head
        self.options = options
        self._reads_checked = False
        self._slots: Slots = parameter_slots(head, self.params)

    def compute_tensors(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        """Each trainable tensor in a slot of the head as a stand-in for the call (``hookless_stand_ins``), which
        the head's slots hold around each shard's forward."""
        return tuple(hookless_stand_ins(tensors, [bool(slots) for slots in self._slots]))

    @contextlib.contextmanager
    def _holding(self, stand_ins: Sequence[torch.Tensor]) -> Iterator[None]:
        swapped: Swapped = []
        try:
            put_in_slots(self.head, self._slots, stand_ins, swapped)
            yield
        finally:
            restore_slots(swapped)

    def shard(self, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, dx: Optional[torch.Tensor],
              grads: Optional[GradAccumulator], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        needed = [index for index, need in enumerate(grads.needed if grads is not None else ()) if need]
        with_grad = dx is not None or bool(needed)
        with torch.enable_grad() if with_grad else torch.no_grad():
            x_in = x.detach().requires_grad_(dx is not None)
            # The first shard's reads are checked: later shards run the same code.
            reads = None
            if with_grad and not self._reads_checked:
                reads = TensorReads(known=[x_in, *tensors, *self.params, *self.head.parameters()], grad_only=True,
                                    made_since=next_sequence_nr())
                self._reads_checked = True
            with reads if reads is not None else contextlib.nullcontext(), self._holding(tensors):
                logits = self.head.forward(x_in)
            if reads is not None and reads.foreign:
                raise RuntimeError(HEAD_READ_ERROR.format(head=self.module_name, tensors=describe(reads.foreign_tensors())))
        wide = logits.detach().to(loss_dtype(logits.dtype), copy=True)
        check_targets(targets, wide.shape[-1], self.options.ignore_index)  # the vocabulary shows only now
        loss, grad = cross_entropy_shard(wide, targets, self.options, scale, with_grad)
        if grad is None:
            return loss
        leading = [x_in] if dx is not None else []
        found = grads_via_stand_ins(logits, grad.to(logits.dtype), leading, tensors, self.params, needed, grads)
        if dx is not None:
            dx.copy_(found[0])  # type: ignore[arg-type]  # x_in is read by every head
        return loss
