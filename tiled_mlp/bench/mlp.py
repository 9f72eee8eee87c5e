"""The MLP every benchmark measures: a Llama-style SwiGLU block (gate/up/down, no bias)."""
from __future__ import annotations

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
