"""Exact live-memory accounting with a ``TorchDispatchMode``.

Every storage an op returns is counted once, from the moment it appears until its ``weakref.finalize``
fires; tensors that exist before the measured region (inputs, weights) are added with ``track``.
Unlike the allocator's counters this works on any device and under ``FakeTensorMode``, so the peak of
a 131072-token step can be modelled on a laptop. It does not count allocator fragmentation or
workspace memory inside library kernels (cuBLAS), which ``torch.cuda.max_memory_allocated`` does.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveMemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._live = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def track(self, *tensors) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def _add(self, tensor: torch.Tensor) -> None:
        if hasattr(tensor, "to_local"):
            # A DTensor is a wrapper without storage of its own; this rank holds its local shard.
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out
