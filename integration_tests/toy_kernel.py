"""A per-shard kernel the package does not ship, for a toy MLP, added through ``register_kernel`` alone.

``TanhMLP`` computes ``fc2(tanh(fc1(x)))``; ``TanhMLPKernel`` claims exactly that class and computes a
shard's forward and backward by hand (no autograd): ``h = tanh(x W1^T + b1)``, ``y = h W2^T + b2``;
``dW2 += dy^T h``, ``db2 += sum dy``, ``dz = (dy W2) * (1 - h^2)``, ``dW1 += dz^T x``, ``db1 += sum dz``,
``dx = dz W1``.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tiled_mlp import Kernel, KernelCall

NAME = "test_tanh_mlp"
NOT_MINE = "not a TanhMLP"


class TanhMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TanhShardKernel:
    may_read_other_tensors = False  # it computes from the tensors it is given, nothing else
    replays_rng = False

    def __init__(self, module: TanhMLP):
        self.module_name = type(module).__name__
        self.params = [module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias]
        self.owned_params = self.params

    def remember_reads(self, tensors: Sequence[torch.Tensor]) -> None:
        """Never called: it reads nothing but its tensors."""

    def using(self, tensors: Sequence[torch.Tensor]):
        return contextlib.nullcontext()

    def forward_shard(self, x_shard, out_shard: Optional[torch.Tensor], tensors, shard=None) -> torch.Tensor:
        w1, b1, w2, b2 = tensors
        out = F.linear(torch.tanh(F.linear(x_shard, w1, b1)), w2, b2)
        return out if out_shard is None else out_shard.copy_(out)

    def backward_shard(self, x_shard, grad_out_shard, grad_in_shard, grads, tensors, shard=None) -> None:
        w1, b1, w2, _ = tensors
        h = torch.tanh(F.linear(x_shard, w1, b1))
        grads.add_matmul(2, grad_out_shard.t(), h)
        grads.add_rowsum(3, grad_out_shard)
        dz = torch.mm(grad_out_shard, w2) * (1 - h * h)
        grads.add_matmul(0, dz.t(), x_shard)
        grads.add_rowsum(1, dz)
        if grad_in_shard is not None:
            torch.mm(dz, w1, out=grad_in_shard)


class TanhMLPKernel(Kernel):
    name = NAME
    shape = "map"
    keeps_grad_buffers = False

    def why_not(self, call: KernelCall) -> str:
        return "" if isinstance(call.module, TanhMLP) and not call.token_inputs else NOT_MINE

    def build(self, call: KernelCall) -> TanhShardKernel:
        return TanhShardKernel(call.module)  # type: ignore[arg-type]  # why_not checked the class
