"""The MLP every benchmark measures: a Llama-style SwiGLU block (gate/up/down, no bias)."""
from __future__ import annotations

import math

import torch
from torch import nn


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype=torch.float32, device=None):
        super().__init__()
        kwargs = dict(bias=False, dtype=dtype, device=device)
        # dtype/device in the constructors: inside FakeTensorMode `.to(dtype)` fails.
        self.gate_proj = nn.Linear(hidden, intermediate, **kwargs)
        self.up_proj = nn.Linear(hidden, intermediate, **kwargs)
        self.down_proj = nn.Linear(intermediate, hidden, **kwargs)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def seeded_mlp(hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, seed: int) -> SwiGLUMLP:
    """The benchmarks' MLP: weights drawn from ``seed``, scaled by 1/sqrt(fan-in) (activations of unit size)."""
    torch.manual_seed(seed)
    mlp = SwiGLUMLP(hidden, intermediate, dtype=dtype, device=device)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return mlp
