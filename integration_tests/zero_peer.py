"""DeepSpeed's own TiledMLP (``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``) as a peer.

It is an autograd Function called from the MLP's forward (the way its docstring patches LlamaMLP);
under ZeRO-3 it is handed the parameters (``compute_params``) so that it can hold back their
gradient reduction until its last shard.
"""
from __future__ import annotations

from torch import nn

from .toy_models import GatedMLP, LoRALinear


def _untiled_forward(module: nn.Module, x):
    return GatedMLP.forward(module, x)


class DeepSpeedTiledGatedMLP(GatedMLP):
    num_shards = 1

    def forward(self, x):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        return TiledMLP.apply(_untiled_forward, self, x, self.num_shards, list(self.parameters()))


def use_deepspeed_tiled_mlp(mlp: GatedMLP, num_shards: int) -> GatedMLP:
    """Turn a GatedMLP (LoRA or not) into the peer in place: same parameters, same names."""
    assert all(isinstance(getattr(mlp, n), (nn.Linear, LoRALinear)) for n in ("gate_proj", "up_proj", "down_proj"))
    mlp.__class__ = DeepSpeedTiledGatedMLP
    mlp.num_shards = num_shards
    return mlp
