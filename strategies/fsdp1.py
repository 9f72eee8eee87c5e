"""FSDP1 (``FullyShardedDataParallel``) is refused: it flattens parameters into a ``FlatParameter`` and owns
their views, so the module's parameters are not the tensors autograd accumulates into."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import SequenceParallelAware, Strategy, UnsupportedBackendError, claims_need_process_group

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


class FSDP1Strategy(SequenceParallelAware, Strategy):
    """Sequence-parallel aware with nothing to check: ``check_supported`` refuses every call first."""

    name = "fsdp1"
    priority = 1000  # ask first: a refusal must win over any strategy that would run it
    claims_from_layout = True

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """FSDP1 wraps an ancestor, or owns a parameter anywhere in the module's subtree."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        return any(isinstance(m, FullyShardedDataParallel) for m in (*ancestors, *module.modules())) or any(
            _is_fsdp1_tensor(t) for m in module.modules() for t in (*vars(m).values(), *m._parameters.values()))

    def check_supported(self, module: nn.Module) -> None:
        raise UnsupportedBackendError(FSDP1_ERROR)
