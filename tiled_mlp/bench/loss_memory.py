"""Exact peak memory of one loss forward+backward at full size, modelled with fake tensors, and the
figures it is held to.

Nothing is allocated (``FakeTensorMode``: shapes and dtypes only); the tracker counts every storage
alive, the hidden states x, the head's weight W, the labels and the gradients dx and dW included.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tiled_mlp.core.loss_shards import LOSS_ELEMENT_BYTES, loss_num_shards
from tiled_mlp.core.shard_plan import make_shard_plan

from .loss_methods import LossMethod
from .loss_peak_tracker import LossPeakTracker


@dataclass
class PeakResult:
    peak_bytes: Optional[int] = None  # None: not measurable, see ``error``
    error: Optional[str] = None
    answered: List[str] = field(default_factory=list)  # value-dependent branches answered False
    largest: List[Tuple[str, int, int]] = field(default_factory=list)  # (what, bytes each, count) at the peak


def fake_peak(method: LossMethod, tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> PeakResult:
    """The modelled peak of ``method``; a path that cannot run on fake tensors is reported, not raised."""
    try:
        with FakeTensorMode():
            head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
            x = torch.empty(1, tokens, hidden, dtype=dtype, requires_grad=True)
            labels = torch.zeros(1, tokens, dtype=torch.long)
            step = method.make(head)
            tracker = LossPeakTracker()
            tracker.name(x, "x")
            tracker.name(head.weight, "W")
            tracker.name(labels, "labels")
            tracker.track(x, head.weight, labels)
            with tracker:
                step(x, labels).backward()
            if x.grad is None or head.weight.grad is None:
                return PeakResult(error="the step gave no dx or no dW")
            return PeakResult(tracker.peak_bytes, None, tracker.answered, tracker.largest_at_peak())
    except Exception as error:  # not measurable this way: say why instead of ending the run
        lines = str(error).strip().splitlines()
        return PeakResult(error=f"{type(error).__name__}: {lines[0] if lines else ''}"[:300])


@dataclass(frozen=True)
class MemoryReference:
    floor_bytes: int  # x + dx + W + dW
    shard_tokens: int  # the largest of our auto shards
    shard_pair_bytes: int  # one shard's float32 logits and their float32 gradient

    @property
    def floor_plus_shard(self) -> int:
        return self.floor_bytes + self.shard_pair_bytes


def memory_reference(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> MemoryReference:
    element = dtype.itemsize
    floor = 2 * tokens * hidden * element + 2 * vocab * hidden * element
    shard_tokens = max(make_shard_plan(tokens, loss_num_shards(tokens, vocab)).shard_sizes)
    return MemoryReference(floor, shard_tokens, 2 * shard_tokens * vocab * LOSS_ELEMENT_BYTES)
