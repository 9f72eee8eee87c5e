"""A loss over a sequence split across ranks (sequence parallelism): summed per rank, divided once.

Under sequence parallelism (Ulysses, context parallelism) each rank of a group holds a slice of the same
sequences, and so a slice of the loss's tokens. The loss of the whole sequence is the sum of every
rank's per-token losses divided once by the count of valid tokens over the whole group (or by the
count the caller gives: every SP rank, DP rank and accumulation step of one optimizer step). A mean of
per-rank means is wrong as soon as the ranks' masks differ (a prompt masked on one rank only).

Two collectives, both on the group, both of one scalar:

- ``group_count``: the valid-token count, summed over the group before the loss is computed (no
  gradient; it only divides).
- ``sum_over_group``: the per-rank partial losses summed, differentiably. Every rank returns the loss
  of the whole sequence, and its backward sums the incoming gradients over the group too. So when each
  rank runs ``loss.backward()``, a rank's partial loss receives the group size: the gradient backends
  produce after averaging over their ranks (DDP, FSDP2 and DeepSpeed ZeRO-3 average over the world, the
  SP ranks among them) is the whole sequence's, exactly as if one rank had run it. This is the
  convention of Hugging Face's DeepSpeed-SP loss (a differentiable all-gather, weighted), in one
  all-reduce. A backend that divides by the DP size only, summing over the SP ranks (DeepSpeed's stage 0
  and ZeRO-1/2 under its SP groups, ZeRO-3 without reduce-scatter), says so
  (``SequenceParallelAware.sums_over_sequence_ranks``, a strategy's capability, read from the backend's own
  objects) and the backward then hands each rank 1 instead. A backend whose reduction does not span the
  group, or one in play that cannot say (no such capability), is refused before the loss
  (``SequenceParallelAware.check_sequence_group``).

torch.distributed only: no backend module is imported.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def check_group(group: Any) -> None:
    """A clear error, before any work, for a group that cannot carry the loss."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tiled loss: sequence_group was given but torch.distributed is not initialized; "
                           "initialize the process group first, or pass sequence_group=None on one rank")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tiled loss: sequence_group must be a torch.distributed ProcessGroup, got {type(group).__name__}")


def group_count(targets: torch.Tensor, ignore_index: int, group: Any, dtype: torch.dtype) -> torch.Tensor:
    """The number of valid targets over every rank of ``group``, as a ``dtype`` scalar on ``targets``' device."""
    count = (targets != ignore_index).sum().to(torch.float64 if dtype == torch.float64 else torch.float32)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count.to(dtype)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward and backward: the backward of a sum that every rank computes (divided by
    the group's size where the backend sums, rather than averages, the gradients over the group)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: Any, backend_averages: bool) -> torch.Tensor:
        ctx.group, ctx.backend_averages = group, backend_averages
        total = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.group)
        if not ctx.backend_averages:
            summed.div_(dist.get_world_size(ctx.group))
        return summed, None, None


def sum_over_group(partial: torch.Tensor, group: Optional[Any], backend_averages: bool = True) -> torch.Tensor:
    """``partial`` summed over ``group``, differentiably (see the module docstring). ``backend_averages``:
    the backend divides the gradients by the group's ranks (not ``SequenceParallelAware.sums_over_sequence_ranks``)."""
    return partial if group is None else _SumOverGroup.apply(partial, group, backend_averages)
