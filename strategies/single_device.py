"""One device: parameters local and whole, gradients once through autograd, an unused parameter's gradient left
None as untiled. Under sequence parallelism it reduces nothing across ranks, so it sums over none of them."""
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
