"""FSDP2 (``torch.distributed.fsdp.fully_shard``).

When the tiled module sits inside an FSDP2 unit (decoder layer, root) or is one itself, FSDP2's own
module hooks unshard the parameters before the tiled call and again before its backward, and
reduce-scatter the gradients that autograd accumulated into the unsharded parameters; the tiled core
delivers each gradient once, so nothing more is needed here.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import Strategy, UnsupportedBackendError


def _fsdp_module_class():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


class FSDP2Strategy(Strategy):
    name = "fsdp2"
    priority = 100

    @classmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        fsdp_module = _fsdp_module_class()
        return any(isinstance(m, fsdp_module) for m in (*ancestors, *module.modules()))

    def check_supported(self, module: nn.Module) -> None:
        fsdp_module = _fsdp_module_class()
        inner = [name for name, m in module.named_modules() if name and isinstance(m, fsdp_module)]
        if inner:
            raise UnsupportedBackendError(
                "TiledMLP cannot tile a module whose submodules are FSDP2 units of their own "
                f"({', '.join(inner)}): each would unshard and reshard once per token shard. Call fully_shard "
                "on the MLP (or on the TiledMLP, or the decoder layer containing it) instead of on its Linears."
            )
