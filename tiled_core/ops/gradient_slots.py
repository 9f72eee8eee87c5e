"""How the custom ops hand gradients back: an op returns tensors only, so a gradient it did not form is an empty
slot (a 0-element tensor of its input's dtype and device), and the registered backward gives autograd None for it."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

NOT_FORMED = 0  # the length of a slot that holds no gradient


def slot(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``grad``, or an empty slot like ``like`` where none was formed."""
    return like.new_empty(NOT_FORMED) if grad is None else grad


def fake_slots(tensors: Sequence[torch.Tensor], formed: Sequence[bool]) -> List[torch.Tensor]:
    """A fake kernel's gradients: contiguous, whatever the tensor's own layout, as the ops form them (rows of the
    flattened input, products of ``mm``); a fake copying the input's layout would tell the compiler wrong strides."""
    return [t.new_empty(t.shape) if f else t.new_empty(NOT_FORMED) for t, f in zip(tensors, formed, strict=True)]
