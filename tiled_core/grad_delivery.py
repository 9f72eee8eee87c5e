"""The one gradient delivery shared by both autograd shapes (the token-wise map and the reduction).

Each parameter's gradient is summed over all shards (``GradAccumulator``) and returned from the
Function's ``backward``, so autograd accumulates it into ``.grad`` exactly once per backward: what
DDP's reducer, FSDP2's reduce-scatter and ZeRO's per-parameter hooks each expect. The strategy decides
what an unused trainable parameter gets (zeros for a backend that waits for every reachable one) and
may transform what is delivered (``Strategy.deliver_grads``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch

from .grad_accum import GradAccumulator

if TYPE_CHECKING:
    from .sharded_autograd import ShardedRun


def needed_grads(run: ShardedRun[Any], needs_input_grad: Sequence[bool], num_params: int) -> List[bool]:
    """Which of the Function's tensors get a gradient: those autograd asks for, less the parameters the
    strategy leaves out (``param_mask``); tensors after the parameters (found reading the forward)
    always get theirs."""
    mask = run.param_mask
    return [need and (mask is None or i >= num_params or mask[i]) for i, need in enumerate(needs_input_grad)]


def delivered_grads(run: ShardedRun[Any], grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                    num_params: int) -> List[Optional[torch.Tensor]]:
    """The gradients the Function returns for ``tensors`` (the parameters first). Called where the
    parameters are whole (zeros for an unused one need its full shape)."""
    result = grads.results(run.zeros_for_unused)
    if run.deliver_grads is not None:
        result[:num_params] = run.deliver_grads(tensors[:num_params], result[:num_params])
    return result
