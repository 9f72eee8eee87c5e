"""DDP (``DistributedDataParallel``): parameters are local and whole, gradients arrive once through autograd and
DDP's reducer all-reduces them. DDP wraps the root, usually after tiling, so no recorded ancestor shows it: while
its forward runs it is ``DistributedDataParallel._active_ddp_module`` (private, set for torch.compile's DDP
optimizer)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from .base import (
    SequenceParallelAware,
    Strategy,
    WaitsForEveryParameter,
    check_spans_sequence_group,
    claims_need_process_group,
    process_group_ready,
)


def wrapping_ddp(ancestors: Sequence[nn.Module] = ()) -> Optional[Any]:
    """The innermost recorded DDP ancestor, else the DDP module whose forward runs, else None."""
    from torch.nn.parallel import DistributedDataParallel

    recorded = [m for m in ancestors if isinstance(m, DistributedDataParallel)]
    return recorded[-1] if recorded else getattr(DistributedDataParallel, "_active_ddp_module", None)


class DDPStrategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):
    name = "ddp"
    priority = 50
    configures_from_runtime = True

    def __init__(self, process_group: Optional[Any] = None):
        #: The process group DDP averages gradients over; None: the running DDP module's, where one runs.
        self.process_group = process_group

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        # A module called inside a DDP forward but not wrapped by it (a frozen teacher) would get zeros for
        # unused trainable parameters instead of None, nothing else.
        return wrapping_ddp(ancestors) is not None

    @classmethod
    def configured_for(cls, module: nn.Module, ancestors: Sequence[nn.Module] = (), **init_kwargs: Any) -> DDPStrategy:
        """The process group of the DDP module around the call, unless one was registered."""
        ddp = wrapping_ddp(ancestors)
        if init_kwargs.get("process_group") is None and ddp is not None:
            init_kwargs = {**init_kwargs, "process_group": ddp.process_group}
        return cls(**init_kwargs)

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        """DDP's process group must hold every SP rank. Without one given, the running DDP module's where it wraps
        ``module``; a loss computed after it returned is checked only against a given group."""
        import torch.distributed as dist

        process_group = self.process_group
        if process_group is None:
            ddp = wrapping_ddp() if process_group_ready() else None
            if ddp is None or not any(m is module for m in ddp.module.modules()):
                return
            process_group = ddp.process_group
        check_spans_sequence_group("DDP", module, dist.get_process_group_ranks(process_group), group,
                                   "Wrap the model in DDP over every rank (the default process group) under SP.")
