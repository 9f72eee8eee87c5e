"""TRL's fused LM head, as the tiled loss sees it: recognised by what it is, on the TRL versions it was read on.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``) call
``trl.trainer.utils.add_fused_lm_head(model)`` when they are built. It sets ``model.forward`` to a method
bound to the model whose function is a closure (``_fused_forward``) over the forward the model had then
(``original_forward``), made to look like the class's forward (``functools.wraps(type(model).forward)``:
its ``__name__``, ``__qualname__``, ``__module__`` and ``__wrapped__`` are the class forward's). Called with
``fused_lm_head=True`` (every labelled call TRL's trainers make), it runs the decoder itself
(``model.base_model``) and computes per-token log-probabilities through ``lm_head`` in tiles of tokens and
vocabulary (``trl.kernels.ChunkedLogProbFunction``), never the ``[tokens, vocab]`` logits, and the trainer
forms the loss from them; ``original_forward`` is not called. Without ``fused_lm_head`` it calls
``original_forward`` with the arguments as given.

So the loss TRL's trainers train on never passes through the model's forward: TRL already computes it
without the logits, and a tiled loss on that forward would not run for it. What this module gives the
tiled loss:

- ``fused_head(forward)``: TRL's fused forward and what it wraps, when ``forward`` is one. Recognised by
  its code object, which is the nested function's code that the installed ``add_fused_lm_head`` holds
  (each call makes a new closure over that one code object; ``functools.wraps`` changes names, not code),
  and read through its closure cell ``original_forward``. On a TRL version it was not read on, that is
  refused: the closure's layout and what the fused call does could differ.
- ``describe``: who TRL is in a message (its version and function).

TRL is never imported here: its fused forward can only exist once ``trl.trainer.utils`` is imported.
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
