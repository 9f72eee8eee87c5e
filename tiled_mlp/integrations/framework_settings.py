"""What a training framework's entry point tiles (``axolotl.py``, ``llamafactory.py``), and the framework releases
it was checked on: how a framework calls its plugins is read from its source at one release and tested there end
to end, so any other release is refused when the entry point is applied, not when it is imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from torch import nn

from tiled_mlp.core.shard_plan import NumShards
from tiled_mlp.strategies.checked_versions import checked_on, in_any, installed

from .hf import apply_tiled_mlp
from .report import TilingReport


@dataclass(frozen=True)
class FrameworkTiling:  # read from user input by ``args.read_settings``; the fields are apply_tiled_mlp's arguments
    num_shards: NumShards = "auto"  # the MLPs' and the norms' shards
    loss: bool = True  # the causal LM's loss, through the tiled LM head + cross entropy
    loss_num_shards: NumShards = "auto"
    norms: bool = True  # the RMSNorms of the hidden size

    def apply(self, model: nn.Module) -> TilingReport:
        return apply_tiled_mlp(model, **vars(self))


class FrameworkVersionError(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckedFramework:
    label: str  # the framework's name in messages ("Axolotl")
    distribution: str  # its distribution name (``pip install NAME``)
    checked: Tuple[str, ...]  # exact release strings

    def require(self) -> None:
        """Refuses (``FrameworkVersionError``) to run this entry point with what is installed, but for a checked
        release."""
        found = installed(self.distribution)
        wanted = ", ".join(self.checked)
        pin = f"pip install {self.distribution}=={self.checked[-1]}"
        if found is None:
            raise FrameworkVersionError(f"tiled-mlp's {self.label} entry point needs {self.distribution} ({wanted}); "
                                        f"it is not installed: {pin}")
        if not in_any(checked_on(self.distribution, self.checked, exact=True), found):
            raise FrameworkVersionError(
                f"tiled-mlp's {self.label} entry point was checked on {self.distribution} {wanted}, not {found}: how "
                f"{self.label} calls it may differ, so it refuses rather than tile at the wrong moment. Install a "
                f"checked release ({pin}) or a tiled-mlp that lists {found}.")


AXOLOTL = CheckedFramework("Axolotl", "axolotl", ("0.21.0",))
LLAMAFACTORY = CheckedFramework("LLaMA-Factory", "llamafactory", ("0.9.5",))
