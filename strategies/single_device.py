"""One device: parameters are local and whole, gradients arrive once through autograd, and a
parameter the call did not use keeps a None gradient, as untiled (DDP: ``ddp.py``).

Under sequence parallelism it reduces nothing across ranks, so it sums over none of them: the loss
keeps its convention (each rank's gradient as a backend averaging over the ranks expects it)."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import SequenceParallelAware, Strategy


class SingleDeviceStrategy(SequenceParallelAware, Strategy):
    name = "single_device"
    priority = -100  # the fallback: claims whatever no backend-specific strategy claimed

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return True
