"""DeepSpeed ZeRO. Stage 3 partitions parameters (they carry ``ds_id``); stages 1 and 2 keep them whole
and reduce gradients from hooks on each parameter, which the core's single delivery satisfies."""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import Strategy


def is_zero3_param(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


class DeepSpeedZeroStrategy(Strategy):
    name = "deepspeed_zero"
    priority = 200

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return any(is_zero3_param(p) for p in module.parameters())
