"""DDP (``torch.nn.parallel.DistributedDataParallel``): parameters are local and whole, gradients
arrive once through autograd and DDP's reducer all-reduces them in buckets.

The one difference from a single device is an unused parameter. It is an input of the tiled
Function, so DDP (with or without ``find_unused_parameters``) finds it reachable from the output and
waits for its gradient: it gets zeros, delivered once like the others.

Claiming: DDP wraps the root, usually after the model was tiled, so no recorded ancestor shows it.
While a DDP module runs its forward it is ``DistributedDataParallel._active_ddp_module`` (private,
set by DDP for torch.compile's DDP optimizer); a recorded DDP ancestor also counts. If that attribute
moves, the claim falls back to the single-device strategy, whose only difference is the unused
parameter's None.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import Strategy, WaitsForEveryParameter, check_spans_sequence_group, process_group_ready


def _active_ddp_module():
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None)


class DDPStrategy(WaitsForEveryParameter, Strategy):
    name = "ddp"
    priority = 50

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        if not process_group_ready():
            return False
        from torch.nn.parallel import DistributedDataParallel

        if any(isinstance(m, DistributedDataParallel) for m in ancestors):
            return True
        # A DDP forward running on this thread is what called this module (no walk of the model: this
        # runs at every tiled call). A module called inside it but not wrapped by it (a frozen
        # teacher) would get zeros for unused trainable parameters instead of None, nothing else.
        return _active_ddp_module() is not None

    @classmethod
    def check_sequence_group(cls, module: nn.Module, group) -> None:
        """DDP averages over its ``process_group``: it must hold every SP rank. The DDP module is the one
        whose forward is running (the loss inside the model's forward); a loss computed after it returned
        is not seen here."""
        ddp = _active_ddp_module() if process_group_ready() else None
        if ddp is None or not any(m is module for m in ddp.module.modules()):
            return
        import torch.distributed as dist

        check_spans_sequence_group("DDP", module, dist.get_process_group_ranks(ddp.process_group), group,
                                   "Wrap the model in DDP over every rank (the default process group) under SP.")
