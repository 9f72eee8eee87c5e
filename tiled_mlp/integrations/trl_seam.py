"""TRL's fused LM head, as the tiled loss sees it: recognised by what it is, on the TRL versions it was read on
(docs/long-context-stack.md, "TRL").

TRL's trainers call ``trl.trainer.utils.add_fused_lm_head(model)`` when built: ``model.forward`` becomes a method
whose function is a closure (``_fused_forward``) over the forward the model had (cell ``original_forward``),
made to look like the class's forward with ``functools.wraps``. Called with ``fused_lm_head=True`` (every
labelled call of TRL's trainers) it runs the decoder itself and computes per-token log-probabilities through
``lm_head`` in tiles, never the logits, and never calls ``original_forward``; without it, it calls
``original_forward``. ``fused_head`` recognises it by its code object (the nested function's code in the
installed ``add_fused_lm_head``: names change under ``wraps``, code does not) and refuses a TRL release it was not
read on. TRL is never imported here: its fused forward can exist only once ``trl.trainer.utils`` is.
"""
from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange

# The TRL releases whose ``add_fused_lm_head`` this module was read against (its closure's cell names, and that
# a fused call computes the loss without calling the forward it wraps).
CHECKED = CheckedRange("trl", "1.16.0", "1.16.0")  # its patch releases too (the seams' rule)
_FUNCTION = "add_fused_lm_head"
_NESTED = "_fused_forward"
_WRAPPED_CELL = "original_forward"


@dataclass(frozen=True)
class FusedHead:
    """TRL's fused forward on a model, and the forward it calls for calls without ``fused_lm_head``."""

    forward: types.MethodType  # the method on the model
    inner: Callable  # ``original_forward``: the model's forward when TRL added its head
    version: str

    def describe(self) -> str:
        return f"TRL {self.version}'s fused LM head (trl.trainer.utils.{_FUNCTION})"


@functools.lru_cache(maxsize=4)
def _fused_codes(add_fused_lm_head: Callable) -> FrozenSet[types.CodeType]:
    """The code objects of the fused forward that ``add_fused_lm_head`` defines (one, on the versions read)."""
    code = getattr(add_fused_lm_head, "__code__", None)
    consts = code.co_consts if code is not None else ()
    return frozenset(c for c in consts if isinstance(c, types.CodeType) and c.co_name == _NESTED)


def _version() -> str:
    return checked_versions.installed("trl") or "unknown"


def fused_head(forward: Any) -> Optional[FusedHead]:
    """``forward`` as TRL's fused forward (None when it is not one). Raises where it is one, but of a TRL
    version this module was not read on."""
    utils = sys.modules.get("trl.trainer.utils")
    if utils is None or not isinstance(forward, types.MethodType):
        return None
    add = getattr(utils, _FUNCTION, None)
    function = forward.__func__
    code = getattr(function, "__code__", None)
    if add is None or code is None or code not in _fused_codes(add):
        return None
    version = _version()
    if not CHECKED.contains(version):
        raise RuntimeError(
            f"tiled loss: {type(forward.__self__).__name__}'s forward is TRL's fused LM head (trl.trainer.utils."
            f"{_FUNCTION}), and TRL here is {version}; the tiled loss knows how that head composes with it on "
            f"{CHECKED.describe()} only. Install one of those, or leave the tiled loss off (TRL's head "
            "already computes the loss without the logits)")
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in function.__closure__ or ()), strict=True))
    return FusedHead(forward, cells[_WRAPPED_CELL], version)
