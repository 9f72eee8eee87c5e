"""TRL's fused LM head, as the tiled loss sees it (docs/long-context-stack.md, "TRL").

``trl.trainer.utils.add_fused_lm_head(model)`` makes ``model.forward`` a method whose function is a closure
(``_fused_forward``) over the forward the model had (cell ``original_forward``), named like the class's forward
(``functools.wraps``). Recognised by its code object, on the TRL versions read only. TRL is never imported here:
its fused forward can exist only once ``trl.trainer.utils`` is.
"""
from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange

CHECKED = CheckedRange("trl", "1.16.0", "1.16.0")  # its patch releases too (the seams' rule)


@dataclass(frozen=True)
class FusedHead:
    inner: Callable  # ``original_forward``: the model's forward when TRL added its head
    version: str

    def describe(self) -> str:
        return f"TRL {self.version}'s fused LM head (trl.trainer.utils.add_fused_lm_head)"


def fused_head(forward: Any) -> Optional[FusedHead]:
    """``forward`` as TRL's fused forward (None when it is not one), refused on a TRL version not read."""
    add = getattr(sys.modules.get("trl.trainer.utils"), "add_fused_lm_head", None)
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    if add is None or not isinstance(forward, types.MethodType) or code is None or code.co_name != "_fused_forward":
        return None
    if code not in add.__code__.co_consts:
        return None
    version = checked_versions.installed("trl") or "unknown"
    if not CHECKED.contains(version):
        raise RuntimeError(
            f"tiled loss: {type(forward.__self__).__name__}'s forward is TRL's fused LM head (trl.trainer.utils."
            f"add_fused_lm_head), and TRL here is {version}; the tiled loss knows how that head composes with it on "
            f"{CHECKED.describe()} only. Install one of those, or leave the tiled loss off (TRL's head "
            "already computes the loss without the logits)")
    return FusedHead(inspect.getclosurevars(forward.__func__).nonlocals["original_forward"], version)
