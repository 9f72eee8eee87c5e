"""What a training framework's entry point tiles (``axolotl.py``, ``llamafactory.py``), parsed once.

Both entry points tile the same three things by default, the MLP blocks, the RMSNorms and the causal LM's
loss, in place (``apply_tiled_mlp``), so the trainer's optimizer, built before or after, steps the same
parameters under the same names. The settings are parsed where they are given (a constructor, a config
being validated): a bad value is refused before the framework loads anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tiled_mlp.core.shard_plan import NumShards, parse_num_shards

from .args import parse_bool
from .hf import apply_tiled_mlp
from .report import TilingReport


@dataclass(frozen=True)
class FrameworkTiling:
    num_shards: NumShards = "auto"  # the MLPs' and the norms' shards
    loss: bool = True  # the causal LM's loss, through the tiled LM head + cross entropy
    loss_num_shards: NumShards = "auto"
    norms: bool = True  # the RMSNorms of the hidden size

    @classmethod
    def parse(cls, num_shards: Any = "auto", loss: Any = True, loss_num_shards: Any = "auto", norms: Any = True,
              prefix: str = "") -> FrameworkTiling:
        """The settings from user input; a ``ValueError`` naming the key (``prefix`` + name) for a bad value."""
        def shards(value: Any, name: str) -> NumShards:
            try:
                return parse_num_shards("auto" if value is None else value)
            except (ValueError, TypeError) as error:
                raise ValueError(f"{prefix}{name}: {error}") from None

        def flag(value: Any, name: str) -> bool:
            return True if value is None else parse_bool(value, prefix + name)

        return cls(shards(num_shards, "num_shards"), flag(loss, "loss"), shards(loss_num_shards, "loss_num_shards"),
                   flag(norms, "norms"))

    def apply(self, model: nn.Module) -> TilingReport:
        return apply_tiled_mlp(model, num_shards=self.num_shards, loss=self.loss,
                               loss_num_shards=self.loss_num_shards, norms=self.norms)
