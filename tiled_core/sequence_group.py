"""A loss over a sequence split across ranks (sequence parallelism): summed per rank, divided once by the valid
tokens of the whole group (docs/long-context-stack.md, "The long-sequence stack"). torch.distributed only."""
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
    """All-reduce (sum) forward and backward: every rank returns the whole sequence's loss. The backward hands each
    rank the factor the backend's gradient reduction turns into the whole sequence's gradient: the group's size
    where it averages over the SP ranks, 1 where it sums (``SequenceParallelAware.sums_over_sequence_ranks``)."""

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


def sum_over_group(partial: torch.Tensor, group: Optional[Any], backend_averages: bool) -> torch.Tensor:
    """``partial`` summed over ``group``, differentiably (``_SumOverGroup``)."""
    return partial if group is None else _SumOverGroup.apply(partial, group, backend_averages)
