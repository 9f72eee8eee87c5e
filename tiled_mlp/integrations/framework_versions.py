"""The training frameworks' versions each entry point was checked on, and the refusal of any other.

An entry point for a framework (``axolotl.py``, ``llamafactory.py``) relies on how that framework calls it:
which hook runs when, what it is handed (the model before the optimizer is built, a parsed config). That
contract is read from the framework's source at one release and tested there end to end; another release
may call the hook at another moment, and tiling then could miss the model the trainer steps. So each entry
point names the releases it was checked on here, and refuses any other when it is applied (not when it is
imported), naming the installed version, the checked ones and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Optional, Tuple


class FrameworkVersionError(RuntimeError):
    """The framework installed is not a release the entry point was checked on."""


@dataclass(frozen=True)
class CheckedFramework:
    """A framework's distribution name on the package index and the releases the entry point was tested on."""

    label: str  # the framework's name in messages ("Axolotl")
    distribution: str  # its distribution name (``pip install NAME``)
    checked: Tuple[str, ...]  # exact release strings

    def installed(self) -> Optional[str]:
        try:
            return metadata.version(self.distribution)
        except metadata.PackageNotFoundError:
            return None

    def refusal(self) -> Optional[str]:
        """Why this entry point may not run with what is installed (None: it may)."""
        found = self.installed()
        wanted = ", ".join(self.checked)
        pin = f"pip install {self.distribution}=={self.checked[-1]}"
        if found is None:
            return f"tiled-mlp's {self.label} entry point needs {self.distribution} ({wanted}); it is not installed: {pin}"
        if found.split("+")[0] not in self.checked:  # a local build (``+cpu``) of a checked release is that release
            return (f"tiled-mlp's {self.label} entry point was checked on {self.distribution} {wanted}, not {found}: "
                    f"how {self.label} calls it may differ, so it refuses rather than tile at the wrong moment. "
                    f"Install a checked release ({pin}) or a tiled-mlp that lists {found}.")
        return None

    def require(self) -> str:
        """The installed version; ``FrameworkVersionError`` where it is not one checked."""
        problem = self.refusal()
        if problem is not None:
            raise FrameworkVersionError(problem)
        return self.installed() or ""


AXOLOTL = CheckedFramework("Axolotl", "axolotl", ("0.21.0",))
LLAMAFACTORY = CheckedFramework("LLaMA-Factory", "llamafactory", ("0.9.5",))
