"""The live-storage tracker for loss paths under ``FakeTensorMode``: answers their value-dependent
branches, and keeps what was alive at the peak.

Fake tensors carry no values, so a Python branch on one (``bool(t)``, ``t.item()``: the op
``aten._local_scalar_dense``) raises. The loss paths each branch on a value: ours checks that no label
lies outside the vocabulary (``bool(bad.any())``, False for the bench's labels), DeepSpeed's backward
checks whether the incoming gradient is 1 (``grads[0] != 1.0``; True in the real run, where the branch
scales dx in place, allocating nothing). Each such boolean is answered False here and every call site is
recorded, so the report shows what was answered; a non-boolean value is still refused (it could size a
buffer).

The peak's contents, each storage by the dtype and shape that made it, say which buffer dominates.
"""
from __future__ import annotations

import traceback
from collections import Counter
from typing import Dict, List, Tuple

import torch

from .memory_tracker import LiveMemoryTracker

_SCALAR_OP = torch.ops.aten._local_scalar_dense.default


def _caller() -> str:
    """The innermost frame outside torch and this bench: the line that branched on a value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/tiled_mlp/bench/" not in path:
            return f"{path.rsplit('/', 2)[-2]}/{path.rsplit('/', 1)[-1]}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "unknown caller"


class LossPeakTracker(LiveMemoryTracker):
    def __init__(self):
        super().__init__()
        self._names: Dict[int, str] = {}  # inputs named before they are tracked ("x", "W"), by storage
        self._what: Dict[int, str] = {}
        self.at_peak: List[Tuple[int, str]] = []
        self.answered: List[str] = []

    def name(self, tensor: torch.Tensor, label: str) -> None:
        self._names[tensor.untyped_storage()._cdata] = label

    def _add(self, tensor: torch.Tensor) -> None:
        if hasattr(tensor, "to_local"):  # a DTensor: its local shard is what this rank holds (as the base's)
            tensor = tensor.to_local()
        key = tensor.untyped_storage()._cdata
        if key not in self._what:
            dtype = str(tensor.dtype).replace("torch.", "")
            self._what[key] = self._names.get(key, f"{dtype}{list(tensor.shape)}")
        before = self.peak_bytes
        super()._add(tensor)
        if self.peak_bytes > before:
            self.at_peak = [(nbytes, self._what[k]) for k, nbytes in self._live.items()]

    def _free(self, key) -> None:
        super()._free(key)
        self._what.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _SCALAR_OP and args[0].dtype == torch.bool:
            self.answered.append(_caller())
            return False
        return super().__torch_dispatch__(func, types, args, kwargs)

    def largest_at_peak(self, top: int = 6) -> List[Tuple[str, int, int]]:
        """(what, bytes each, how many) of the largest storages alive at the peak."""
        counts = Counter(self.at_peak)
        ranked = sorted(counts.items(), key=lambda item: -item[0][0] * item[1])
        return [(what, nbytes, n) for (nbytes, what), n in ranked[:top]]
