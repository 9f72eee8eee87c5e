"""Generic per-shard kernel: any token-wise module, recomputed with autograd in backward.

Gradients are taken with ``torch.autograd.grad`` for the shard input and for the parameters that
require grad, so LoRA adapters and partially frozen modules work with no list of weight names.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..grad_accum import GradAccumulator


class GenericShardKernel:
    def __init__(self, forward_fn: Callable, params: List[torch.Tensor], shard_prefix: tuple):
        self.forward_fn = forward_fn
        self.params = params
        # Leading singleton dims so each shard has the rank of the caller's input: modules that
        # reshape a [batch, seq, hidden] input themselves (MoE blocks) keep working.
        self.shard_prefix = shard_prefix

    def _run(self, x_shard: torch.Tensor) -> torch.Tensor:
        y = self.forward_fn(x_shard.view(*self.shard_prefix, *x_shard.shape))
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"TiledMLP's generic path needs a module that returns one tensor, got {type(y).__name__}; "
                "wrap the module so that it returns only the hidden states"
            )
        if y.shape[:-1] != (*self.shard_prefix, x_shard.shape[0]):
            raise ValueError(
                f"TiledMLP needs a token-wise module ([..., tokens, hidden] -> [..., tokens, out]), but a shard "
                f"of shape {tuple(x_shard.shape)} gave an output of shape {tuple(y.shape)}"
            )
        return y.reshape(x_shard.shape[0], y.shape[-1])

    def forward_shard(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor]) -> torch.Tensor:
        y = self._run(x_shard)
        if out_shard is None:
            return y
        return out_shard.copy_(y)

    def backward_shard(
        self,
        x_shard: torch.Tensor,
        grad_out_shard: torch.Tensor,
        grad_in_shard: Optional[torch.Tensor],
        grads: GradAccumulator,
    ) -> None:
        wanted = [i for i, need in enumerate(grads.needed) if need]
        with torch.enable_grad():
            x_leaf = x_shard.detach().requires_grad_(grad_in_shard is not None)
            y = self._run(x_leaf)
        inputs = ([x_leaf] if grad_in_shard is not None else []) + [self.params[i] for i in wanted]
        if not inputs or not y.requires_grad:
            if grad_in_shard is not None:
                grad_in_shard.zero_()
            return
        shard_grads = torch.autograd.grad(y, inputs, grad_out_shard, allow_unused=True)
        if grad_in_shard is not None:
            dx, shard_grads = shard_grads[0], shard_grads[1:]
            if dx is None:
                grad_in_shard.zero_()
            else:
                grad_in_shard.copy_(dx)
        for index, grad in zip(wanted, shard_grads):
            grads.add(index, grad)
