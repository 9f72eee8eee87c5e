"""The local view of a call: how a kernel that computes on plain local tensors sees a module whose
parameters are distributed (DTensor tensor parallelism, ``strategies/tensor_parallel.py``).

The core only speaks of this protocol. A strategy answers ``local_view(module, params)`` (None where the
parameters are plain); ``tiled_call`` picks the view for a kernel that declares ``runs_on_local_view``
and the sharded Function then only ever sees local tensors: the input as ``enter`` made it, the
parameters as ``params`` made them (differentiably: their gradients flow back through the view into the
distributed parameters), and its output is handed to ``leave`` once per call (where the view's one
collective, a reduction of partial sums, happens: never once per token shard).
"""
from __future__ import annotations

from typing import List, Protocol, Sequence

import torch


class LocalView(Protocol):
    #: Why the view cannot stand in for the distributed module ("" where it can): the kernel declines with it.
    why_not: str

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The call's input as this rank's local tensor."""

    def params(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The parameters as this rank's local tensors, differentiable."""

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        """The call's output, from the local one the kernel computed."""
