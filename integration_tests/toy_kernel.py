"""A per-shard kernel the package does not ship, for a toy MLP, added through ``register_kernel`` alone.

``TanhMLP`` computes ``fc2(tanh(fc1(x)))``; ``TanhMLPKernel`` (a registry entry of its own, where the doc's
example registers the ``ShardKernel`` class itself) claims exactly that class, and ``TanhShardKernel`` computes
a shard's forward and backward by hand (no autograd): ``h = tanh(x W1^T + b1)``, ``y = h W2^T + b2``;
``dW2 += dy^T h``, ``db2 += sum dy``, ``dz = (dy W2) * (1 - h^2)``, ``dW1 += dz^T x``, ``db1 += sum dz``,
``dx = dz W1``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tiled_mlp import Kernel, KernelCall
from tiled_mlp.core.kernels import ShardKernel

NAME = "test_tanh_mlp"
NOT_MINE = "not a TanhMLP"


class TanhMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TanhShardKernel(ShardKernel):
    """The doc's minimal form: the module's parameters (``fc1.weight, fc1.bias, fc2.weight, fc2.bias``) in,
    a shard's output and its gradients returned."""

    name = NAME
    module_type = TanhMLP
    replays_rng = False  # the formula draws no random numbers

    def forward_shard(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        w1, b1, w2, b2 = tensors
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)

    def backward_shard(self, x: torch.Tensor, grad_out: torch.Tensor, tensors: Sequence[torch.Tensor]):
        w1, b1, w2, _ = tensors
        h = torch.tanh(F.linear(x, w1, b1))
        dz = torch.mm(grad_out, w2) * (1 - h * h)
        return dz @ w1, [dz.t() @ x, dz.sum(0), grad_out.t() @ h, grad_out.sum(0)]


class TanhMLPKernel(Kernel):
    name = NAME
    shape = "map"

    def why_not(self, call: KernelCall) -> str:
        return "" if isinstance(call.module, TanhMLP) and not call.token_inputs else NOT_MINE

    def build(self, call: KernelCall) -> TanhShardKernel:
        return TanhShardKernel(call.module)  # type: ignore[arg-type]  # why_not checked the class


DOCS_KERNEL_NAME = "tanh_mlp"  # the name docs/architecture.md's example registers


def docs_kernel_example() -> str:
    """The first python block of docs/architecture.md's "Adding a kernel" section, as written there."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = text[text.index("## Adding a kernel"):]
    section = section[:section.index("\n## ", 1)]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the kernel section holds a python example"
    return match.group(1)


def run_docs_kernel_example() -> dict:
    """Run the example verbatim (it registers its kernel: ``unregister_kernel(DOCS_KERNEL_NAME)`` after);
    its namespace."""
    namespace: dict = {"__name__": "kernel_example"}
    exec(compile(docs_kernel_example(), "docs/architecture.md", "exec"), namespace)
    return namespace
