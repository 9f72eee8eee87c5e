from __future__ import annotations

from typing import List, Optional, Protocol

import torch

from ..grad_accum import GradAccumulator


class ShardKernel(Protocol):
    """The per-shard computation. Shards are 2-D ``[shard_tokens, features]`` slices."""

    #: The tensors the autograd Function takes as inputs and returns gradients for, in order.
    params: List[torch.Tensor]

    def forward_shard(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor]) -> torch.Tensor:
        """Compute the shard's output under no_grad, into ``out_shard`` when one is given."""

    def backward_shard(
        self,
        x_shard: torch.Tensor,
        grad_out_shard: torch.Tensor,
        grad_in_shard: Optional[torch.Tensor],
        grads: GradAccumulator,
    ) -> None:
        """Recompute what the shard needs, write its input gradient into ``grad_in_shard`` (when
        given) and add its parameter gradients to ``grads``."""
