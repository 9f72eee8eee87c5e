"""One gradient buffer per parameter, summed over shards.

The buffer is the gradient that ``backward`` returns, so there is no zeroed accumulator beside it:
the first shard's contribution is written into fresh memory (``beta=0`` / plain ``mm``) and later
shards are added in place. Autograd then adds the returned gradient to ``.grad`` exactly once per
backward, which keeps pre-existing ``.grad`` (micro-batch accumulation) and fires every backend's
gradient hook once.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class GradAccumulator:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        needed: Sequence[bool],
        accum_dtype: Optional[torch.dtype] = None,
    ):
        self._params = list(params)
        self.needed = list(needed)
        # None means "the parameter's own dtype": no extra buffer, no cast at the end.
        self._accum_dtype = accum_dtype
        self._buffers: List[Optional[torch.Tensor]] = [None] * len(self._params)

    def dtype_for(self, index: int) -> torch.dtype:
        """The dtype gradient ``index`` is summed in."""
        own = self._params[index].dtype
        # grad_accum_dtype raises precision (bf16 -> fp32); it never lowers it (fp64 stays fp64).
        return own if self._accum_dtype is None else torch.promote_types(self._accum_dtype, own)

    def add(self, index: int, grad: Optional[torch.Tensor]) -> None:
        """grad[index] += grad (a None contribution is skipped: the parameter was unused)."""
        if grad is None or not self.needed[index]:
            return
        buffer = self._buffers[index]
        if buffer is None:
            # Take ownership of the shard's gradient instead of copying it into a new buffer.
            self._buffers[index] = grad if grad.dtype == self.dtype_for(index) else grad.to(self.dtype_for(index))
        else:
            buffer.add_(grad)

    def add_matmul(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """grad[index] += a @ b, written straight into the buffer when dtypes allow it."""
        if not self.needed[index]:
            return
        buffer = self._buffers[index]
        if self.dtype_for(index) != a.dtype:
            self.add(index, torch.mm(a, b))
        elif buffer is None:
            self._buffers[index] = torch.mm(a, b)
        else:
            buffer.addmm_(a, b)

    def add_rowsum(self, index: int, rows: torch.Tensor) -> None:
        """grad[index] += rows.sum(0): bias gradients."""
        if not self.needed[index]:
            return
        buffer = self._buffers[index]
        if buffer is None or self.dtype_for(index) != rows.dtype:
            self.add(index, rows.sum(0, dtype=self.dtype_for(index)))
        else:
            buffer.add_(rows.sum(0))

    def results(self, zeros_for_unused: bool = False) -> List[Optional[torch.Tensor]]:
        """The summed gradients in each parameter's dtype; None where no gradient is needed.

        A trainable parameter the module did not use gets None, as untiled, unless
        ``zeros_for_unused``: it is an input of the tiled Function, so a backend that waits for every
        reachable parameter (DDP's reducer) must see its gradient arrive, exactly once like the others.
        """
        out: List[Optional[torch.Tensor]] = []
        for param, buffer, needed in zip(self._params, self._buffers, self.needed, strict=True):
            if not needed:
                out.append(None)
            elif buffer is None:
                out.append(torch.zeros_like(param) if zeros_for_unused else None)
            else:
                out.append(buffer if buffer.dtype == param.dtype else buffer.to(param.dtype))
        return out
