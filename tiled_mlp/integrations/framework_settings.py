"""What a training framework's entry point tiles (``axolotl.py``, ``llamafactory.py``), parsed once.

Both entry points tile the same three things by default, the MLP blocks, the RMSNorms and the causal LM's
loss, in place (``apply_tiled_mlp``), so the trainer's optimizer, built before or after, steps the same
parameters under the same names. The settings are parsed where they are given (a constructor, a config
being validated): a bad value is refused before the framework loads anything.

An entry point also relies on how its framework calls it: which hook runs when, what it is handed. That contract
is read from the framework's source at one release and tested there end to end, so each entry point names the
releases it was checked on (``CheckedFramework``) and refuses any other when it is applied (not when it is
imported), naming the installed version, the checked ones and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from torch import nn

from tiled_mlp.core.shard_plan import NumShards
from tiled_mlp.strategies.checked_versions import checked_on, in_any, installed

from .args import parse_bool, parse_shards
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
            return parse_shards("auto" if value is None else value, prefix + name)

        def flag(value: Any, name: str) -> bool:
            return True if value is None else parse_bool(value, prefix + name)

        return cls(shards(num_shards, "num_shards"), flag(loss, "loss"), shards(loss_num_shards, "loss_num_shards"),
                   flag(norms, "norms"))

    def apply(self, model: nn.Module) -> TilingReport:
        return apply_tiled_mlp(model, num_shards=self.num_shards, loss=self.loss,
                               loss_num_shards=self.loss_num_shards, norms=self.norms)


class FrameworkVersionError(RuntimeError):
    """The framework installed is not a release the entry point was checked on."""


@dataclass(frozen=True)
class CheckedFramework:
    """A framework's distribution name on the package index and the exact releases an entry point was tested on."""

    label: str  # the framework's name in messages ("Axolotl")
    distribution: str  # its distribution name (``pip install NAME``)
    checked: Tuple[str, ...]  # exact release strings

    def refusal(self) -> Optional[str]:
        """Why this entry point may not run with what is installed (None: it may)."""
        found = installed(self.distribution)
        wanted = ", ".join(self.checked)
        pin = f"pip install {self.distribution}=={self.checked[-1]}"
        if found is None:
            return f"tiled-mlp's {self.label} entry point needs {self.distribution} ({wanted}); it is not installed: {pin}"
        if not in_any(checked_on(self.distribution, self.checked, exact=True), found):
            return (f"tiled-mlp's {self.label} entry point was checked on {self.distribution} {wanted}, not {found}: "
                    f"how {self.label} calls it may differ, so it refuses rather than tile at the wrong moment. "
                    f"Install a checked release ({pin}) or a tiled-mlp that lists {found}.")
        return None

    def require(self) -> str:
        """The installed version; ``FrameworkVersionError`` where it is not one checked."""
        problem = self.refusal()
        if problem is not None:
            raise FrameworkVersionError(problem)
        return installed(self.distribution) or ""


AXOLOTL = CheckedFramework("Axolotl", "axolotl", ("0.21.0",))
LLAMAFACTORY = CheckedFramework("LLaMA-Factory", "llamafactory", ("0.9.5",))
