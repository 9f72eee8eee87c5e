"""What autograd checks about a saved tensor, checked for the tensors a tiled call keeps by reference,
and the same check for the plain Python values its recompute reads again.

Autograd refuses a backward whose saved tensors were modified in place after they were saved (an
optimizer step or in-place clipping between forward and backward): "one of the variables needed for
gradient computation has been modified by an inplace operation". The tiled call recomputes from its
input, its parameters and every other tensor its forward read, held as plain references (backends swap
parameter storage between forward and backward, which a saved tensor would refuse), so it records
their version counters itself and compares them when its backward starts, with autograd's wording.

The generic path's recompute also reads the module's Python attributes again (``self.scale = 2.0``,
``GELU.approximate``, ``Dropout.training``), which have no version counter: ``PlainValues`` holds the
ones its code may read (``plain_values``) as they were at the forward and compares them the same way.
Activation checkpointing has no such check; rebound there, a value silently changes the gradients.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from .plain_values import same_value
from .tensor_reads import describe

MODIFIED_ERROR = (
    "one of the variables needed for gradient computation has been modified by an inplace operation: "
    "{tensor} is at version {now}; expected version {then} instead. It was read by {where} in its forward, "
    "and the backward recomputes from it (TiledMLP). Make the in-place change after the backward, or on a copy."
)
INPUT_EDITED_ERROR = (
    "TiledMLP: the forward of {module} modified its input in place. The tiled backward recomputes each shard "
    "from the input, which no longer holds what the forward saw, so its gradients would be wrong. Compute on "
    "a copy (x = x * 2 instead of x.mul_(2)), or run the module untiled (remove_tiled_mlp / untile)."
)
DOUBLE_BACKWARD_ERROR = (
    "TiledMLP does not support double backward: a backward with create_graph=True reached it "
    "(torch.autograd.functional.hessian or hvp, a gradient penalty). Its backward recomputes shard by shard "
    "without building a graph, so every second-order term through it would be zero. Run this module untiled "
    "for second-order gradients (tiled_mlp.remove_tiled_mlp(model) or tiled_core.untile(module))."
)
VALUE_CHANGED_ERROR = (
    "one of the values needed for gradient computation has been changed: {name} of {module} is {now}; expected "
    "{then} instead. The forward of {module} may read it, and the backward recomputes that forward (TiledMLP), so "
    "it would compute with the new value and its gradients would be wrong. Change it after the backward (or "
    "before the forward); if the forward itself changes it, run this module untiled (remove_tiled_mlp / untile)."
)
CHANGED_READ_ERROR = (
    "TiledMLP: a tensor the forward of {module} read without a gradient changed between its forward and its "
    "backward ({what}: {tensors}). The backward recomputes the forward, so it would use other values than the "
    "forward did and its gradients would be wrong (a conditioning tensor set per micro-batch, with two forwards "
    "before their backwards, does this). Keep such a tensor fixed until the backward of each forward that read "
    "it, or pass it as an input."
)


class TensorVersions:
    """The version counters of ``tensors`` now, to be compared with theirs later."""

    __slots__ = ("tensors", "versions")

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors: List[torch.Tensor] = list(tensors)
        self.versions = [t._version for t in self.tensors]

    def changed(self) -> List[int]:
        return [i for i, (t, v) in enumerate(zip(self.tensors, self.versions, strict=True)) if t._version != v]

    def check(self, where: str) -> None:
        changed = self.changed()
        if changed:
            i = changed[0]
            raise RuntimeError(MODIFIED_ERROR.format(tensor=describe([self.tensors[i]]), now=self.tensors[i]._version,
                                                     then=self.versions[i], where=where))


_UNSET = object()


class PlainValues:
    """Plain values held in module attributes now (``plain_values.snapshot``: qualified name, the owning
    module's ``__dict__``, attribute, value), to be compared with theirs later, as ``TensorVersions``."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[Tuple[str, dict, str, Any]]):
        self.entries = list(entries)

    def changed(self) -> List[Tuple[str, Any, Any]]:
        """(qualified name, value then, value now) of each value that is no longer what it was."""
        out = []
        for name, d, attr, then in self.entries:
            now = d.get(attr, _UNSET)
            if now is not then and (now is _UNSET or not same_value(then, now)):
                out.append((name, then, now))
        return out

    def check(self, where: str) -> None:
        changed = self.changed()
        if changed:
            name, then, now = changed[0]
            shown = "unset" if now is _UNSET else repr(now)
            raise RuntimeError(VALUE_CHANGED_ERROR.format(name=name, module=where, now=shown, then=repr(then)))
