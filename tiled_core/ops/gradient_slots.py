"""How the ops hand gradients back. A custom op returns tensors only, so a gradient it did not form is an
empty slot (a 0-element tensor of its input's dtype and device), and the registered backward gives autograd
None for it."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

NOT_FORMED = 0  # the length of a slot that holds no gradient


def slot(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``grad``, or an empty slot like ``like`` where none was formed."""
    return like.new_empty(NOT_FORMED) if grad is None else grad


def fake_slots(tensors: Sequence[torch.Tensor], formed: Sequence[bool]) -> List[torch.Tensor]:
    """A fake kernel's gradients: one of each tensor's shape where it is formed, else an empty slot. Contiguous,
    whatever the tensor's own layout (a transposed input, a column-major weight), as the ops form them: rows of
    the flattened input (``flat_like``) and products of ``mm``. A fake that copied the input's layout
    (``empty_like``) would tell the compiler strides the op does not return."""
    return [t.new_empty(t.shape) if f else t.new_empty(NOT_FORMED) for t, f in zip(tensors, formed, strict=True)]


def flat_like(x_flat: torch.Tensor) -> torch.Tensor:
    """A contiguous buffer of ``x_flat``'s shape (``[tokens, hidden]``): where an op writes an input gradient, so
    that its layout is the fake kernel's (``fake_slots``) whatever the input's."""
    return x_flat.new_empty(x_flat.shape)


def needed_only(grads: Sequence[torch.Tensor], needs: Sequence[bool]) -> List[Optional[torch.Tensor]]:
    """What the backward gives autograd: each gradient that is needed, None for the others."""
    return [g if need else None for g, need in zip(grads, needs, strict=True)]
