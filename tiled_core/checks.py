"""Autograd's saved-tensor version check, for the tensors a tiled call keeps by reference (backends swap
parameter storage between forward and backward, which a saved tensor would refuse), and the same check for the
plain Python values its recompute reads again (``self.scale``, PEFT's active adapter), which have no version
counter: plain values by value, other objects by identity. Activation checkpointing has neither check.
"""
from __future__ import annotations

import operator
from typing import Any, List, Sequence, Tuple

import torch

from .plain_values import ReadSet, is_checked_elsewhere, is_plain, same_value
from .tensor_reads import describe

MODIFIED_ERROR = (
    "one of the variables needed for gradient computation has been modified by an inplace operation: "
    "{tensor} is at version {now}; expected version {then} instead. It was read by {where} in its forward, "
    "and the backward recomputes from it (TiledMLP). Make the in-place change after the backward, or on a copy."
)
INPUT_EDITED_ERROR = (
    "TiledMLP: the forward of {module} modified its input in place. The tiled backward recomputes each shard "
    "from the input, which no longer holds what the forward saw, so its gradients would be wrong. Compute on "
    "a copy (x = x * 2 instead of x.mul_(2)), or run the module untiled (untile(module))."
)
DOUBLE_BACKWARD_ERROR = (
    "TiledMLP does not support double backward: a backward with create_graph=True reached it "
    "(torch.autograd.functional.hessian or hvp, a gradient penalty). Its backward recomputes shard by shard "
    "without building a graph, so every second-order term through it would be zero. Run this module untiled "
    "for second-order gradients (untile(module))."
)
VALUE_CHANGED_ERROR = (
    "one of the values needed for gradient computation has been changed: {name} of {module} is {now}; expected "
    "{then} instead. The forward of {module} may read it, and the backward recomputes that forward (TiledMLP), so "
    "it would compute with the new value and its gradients would be wrong. Change it after the backward (or "
    "before the forward); if the forward itself changes it, run this module untiled (untile(module))."
)
VALUE_CHANGED_BY_FORWARD_ERROR = (
    "TiledMLP: the forward of {module} changes {name} at every call (it was {before} before the forward, {now} "
    "after its first shard was run twice). The backward recomputes each shard's forward, which would read another "
    "value than that shard's forward did, so its gradients would be wrong. Change the value between steps, not "
    "in the forward, or run this module untiled (untile(module))."
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
        self.tensors: Sequence[torch.Tensor] = tuple(tensors)
        self.versions = list(map(version_of, self.tensors))

    def changed(self) -> List[int]:
        return [i for i, (t, v) in enumerate(zip(self.tensors, self.versions, strict=True)) if t._version != v]


version_of = operator.attrgetter("_version")


def raise_modified(tensors: Sequence[torch.Tensor], versions: Sequence[int], where: str) -> None:
    """Autograd's error for the first of ``tensors`` no longer at its version (the caller compared them)."""
    i = next(i for i, (t, v) in enumerate(zip(tensors, versions, strict=True)) if t._version != v)
    raise RuntimeError(MODIFIED_ERROR.format(tensor=describe([tensors[i]]), now=tensors[i]._version,
                                             then=versions[i], where=where))


_UNSET = object()


def _shown(value: Any, by_identity: bool) -> str:
    if value is _UNSET:
        return "unset"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"another {type(value).__name__} object, {text}" if by_identity else text


class PlainValues:
    """The values the module tree's code may read (``read``: which, from ``plain_values.snapshot``) as they are
    when made, to be compared later: plain values by value, other objects by identity."""

    def __init__(self, read: ReadSet):
        self.read = read
        names, modules = read
        self.attrs = [frozenset(d) for _, d in modules]
        self.entries = [(f"{prefix}.{attr}" if prefix else attr, d, attr, d[attr], not is_plain(d[attr]))
                        for prefix, d in modules for attr in sorted(names.intersection(d))
                        if not is_checked_elsewhere(d[attr])]

    def retaken(self) -> PlainValues:
        return PlainValues(self.read)

    def changed(self) -> List[Tuple[str, Any, Any, bool]]:
        """(qualified name, value then, value now, compared by identity) of each value that changed."""
        out = []
        for name, d, attr, then, by_identity in self.entries:
            now = d.get(attr, _UNSET)
            if now is not then and (now is _UNSET or by_identity or not same_value(then, now)):
                out.append((name, then, now, by_identity))
        names, modules = self.read
        for (prefix, d), attrs in zip(modules, self.attrs, strict=True):
            for attr in sorted(names.intersection(d.keys() - attrs)):
                if not is_checked_elsewhere(d[attr]):
                    out.append((f"{prefix}.{attr}" if prefix else attr, _UNSET, d[attr], False))
        return out

    def check(self, where: str) -> None:
        changed = self.changed()
        if changed:
            name, then, now, by_identity = changed[0]
            then_shown = f"the {type(then).__name__} object it was, {_shown(then, False)}" if by_identity else _shown(then, False)
            raise RuntimeError(VALUE_CHANGED_ERROR.format(name=name, module=where, now=_shown(now, by_identity),
                                                          then=then_shown))

    def check_settled(self, where: str, before: PlainValues) -> None:
        """Refuse a forward that changed a value again when its first shard was run a second time."""
        changed = self.changed()
        if changed:
            name, _, now, by_identity = changed[0]
            first = next((then for n, then, _, _ in before.changed() if n == name), _UNSET)
            raise RuntimeError(VALUE_CHANGED_BY_FORWARD_ERROR.format(
                name=name, module=where, before=_shown(first, False), now=_shown(now, by_identity)))
