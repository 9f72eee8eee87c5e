"""FSDP1 (``FullyShardedDataParallel``) is rejected: it flattens parameters into a ``FlatParameter``
and owns their views, so the module's parameters are not the tensors autograd accumulates into."""
from __future__ import annotations

import torch
from typing import Sequence

from torch import nn

from .base import Strategy, UnsupportedBackendError

FSDP1_ERROR = (
    "TiledMLP does not support FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel): it flattens "
    "parameters into FlatParameters whose views TiledMLP cannot deliver gradients to. Use FSDP2 instead: "
    "`from torch.distributed.fsdp import fully_shard` and call fully_shard(layer) for each decoder layer "
    "and fully_shard(model) for the root."
)


def _is_fsdp1_tensor(t) -> bool:
    # FSDP1 marks every original parameter and its FlatParameter with `_fsdp_flattened`; with
    # use_orig_params=False the module holds plain views whose base is the FlatParameter.
    if not isinstance(t, torch.Tensor):
        return False
    return bool(getattr(t, "_fsdp_flattened", False) or getattr(t._base, "_fsdp_flattened", False))


def is_under_fsdp1(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for sub in module.modules():
        if isinstance(sub, FullyShardedDataParallel):
            return True
        if any(_is_fsdp1_tensor(t) for t in vars(sub).values()):
            return True
        if any(_is_fsdp1_tensor(p) for p in sub._parameters.values()):
            return True
    return False


class FSDP1Strategy(Strategy):
    name = "fsdp1"
    priority = 1000  # ask first: a rejection must win over any strategy that would run it

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        import torch.distributed as dist

        return dist.is_available() and any(is_under_fsdp1(m) for m in (*ancestors, module))

    def check_supported(self, module: nn.Module) -> None:
        raise UnsupportedBackendError(FSDP1_ERROR)
