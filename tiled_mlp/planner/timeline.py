"""The live-storage tracker, with a timeline split into what each byte is.

``LiveMemoryTracker`` gives one peak. A rank of a sharded backend holds a fraction of the weights and
gradients but all of its activations, so the planner needs the step's memory by kind at every moment:
weights (tracked before the step), gradients (the storages that end up in ``.grad``, known only when
the step is over), the logits and everything computed from them (tensors whose last dim is the
vocabulary) and other activations. Every allocation and free is logged with a serial number (a freed
storage's address may be reused by the next), and ``Timeline`` replays the log.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch
from torch.utils._pytree import tree_leaves

from ..bench.memory_tracker import LiveMemoryTracker
from .meta_outputs import MetaOutputs
from .meta_values import is_meta_read, zero_read

# Shared by every step of the process: the planner's steps repeat each other's shapes (the settings at
# one length, the layers of one step).
_META_OUTPUTS = MetaOutputs()

WEIGHTS, GRADS, LOGITS, ACTIVATIONS = "weights", "gradients", "logits and loss", "activations"


@dataclass
class Timeline:
    """After each allocation: (weight, gradient, logits, other activation) bytes live."""

    points: List[Tuple[int, int, int, int]]

    def peak(self, weight_scale: float = 1.0, grad_scale: float = 1.0) -> Tuple[float, Tuple[float, float, float, float]]:
        """The peak of ``weights * weight_scale + gradients * grad_scale + logits + activations`` (a rank of
        a backend that divides weights and gradients) and its parts at that moment."""
        best, parts = -1.0, (0.0, 0.0, 0.0, 0.0)
        for w, g, lg, a in self.points:
            total = w * weight_scale + g * grad_scale + lg + a
            if total > best:
                best, parts = total, (w * weight_scale, g * grad_scale, float(lg), float(a))
        return best, parts


class TimelineTracker(LiveMemoryTracker):
    def __init__(self, vocab_size: int):
        super().__init__()
        self._vocab = vocab_size
        self._serial = 0
        self._serial_of: Dict[int, int] = {}  # live storage key -> serial of its allocation
        self._log: List[Tuple[int, int, str]] = []  # (serial, bytes, kind at allocation; "" for a free)
        self._kind = ACTIVATIONS  # what a new storage is, unless its last dim is the vocabulary

    def track_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        self._kind = WEIGHTS
        try:
            self.track(*tensors)
        finally:
            self._kind = ACTIVATIONS

    def _add(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage()._cdata
        if key in self._live:
            return
        kind = self._kind
        if kind == ACTIVATIONS and tensor.dim() >= 1 and tensor.shape[-1] == self._vocab:
            kind = LOGITS
        self._serial += 1
        self._serial_of[key] = self._serial
        nbytes = tensor.untyped_storage().nbytes()
        self._log.append((self._serial, nbytes, kind))
        super()._add(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The base tracker's, with the op's outputs remembered on the meta device (``meta_outputs.py``)
        # and a value read there answered (``meta_values.py``).
        if is_meta_read(func, args):
            return zero_read(args[0])
        out = _META_OUTPUTS.call(func, args, kwargs or {})
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out

    def _free(self, key) -> None:
        serial = self._serial_of.pop(key, None)
        if serial is not None:
            self._log.append((serial, self._live.get(key, 0), ""))
        super()._free(key)

    def timeline(self, grads: Iterable[torch.Tensor]) -> Timeline:
        """Replay the log; ``grads`` (the parameters' ``.grad`` after the step) say which storages were
        gradients all along."""
        grad_serials = {self._serial_of[key] for key in (g.untyped_storage()._cdata for g in grads) if key in self._serial_of}
        kind_of: Dict[int, str] = {}
        live = {WEIGHTS: 0, GRADS: 0, LOGITS: 0, ACTIVATIONS: 0}
        points = []
        for serial, nbytes, kind in self._log:
            if kind:
                kind = GRADS if serial in grad_serials else kind
                kind_of[serial] = kind
                live[kind] += nbytes
                points.append((live[WEIGHTS], live[GRADS], live[LOGITS], live[ACTIVATIONS]))
            else:
                live[kind_of.pop(serial)] -= nbytes
        return Timeline(points)

