"""Small models shared by the distributed tests: residual gated-MLP blocks, optionally tiled, LoRA-style.

Everything is built from a seed so every rank, and the single-process reference, starts from the
same weights.
"""
from __future__ import annotations

import torch
from torch import nn

from tiled_mlp import TiledMLP


def make_act(name: str) -> nn.Module:
    """``silu``, ``gelu`` (exact) or ``gelu_tanh``."""
    if name == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class GatedMLP(nn.Module):
    """Llama style ``down(act(gate(x)) * up(x))``: the fast path's home case."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = make_act(act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (the shape of a PEFT LoRA layer); ``lora_B``
    drawn with ``init_std``, non-zero, so that ``lora_A``'s gradient is non-zero too."""

    def __init__(self, base: nn.Linear, rank: int = 2, init_std: float = 0.1):
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=init_std)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def add_lora(mlp: GatedMLP, rank: int = 4, init_std: float = 0.02) -> GatedMLP:
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, LoRALinear(getattr(mlp, name), rank, init_std))
    return mlp


class Residual(nn.Module):
    """``x + mlp(x)``: a residual around any MLP, the smallest model a tiled module sits in."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(x)


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = GatedMLP(hidden, intermediate, act, bias)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ScaledBlock(nn.Module):
    """``x + scale * mlp(norm(x))``, ``scale`` a buffer: its name must survive tiling too."""

    def __init__(self, hidden: int, mlp: nn.Module, scale: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = mlp
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x):
        return x + self.scale * self.mlp(self.norm(x))


class ToyModel(nn.Module):
    """in_proj -> residual gated-MLP blocks -> head; ``loss(x, target)`` is a mean-squared error."""

    def __init__(self, hidden=16, intermediate=40, layers=2, acts=("silu", "gelu_tanh"), bias=False):
        super().__init__()
        self.in_proj = nn.Linear(hidden, hidden)
        self.layers = nn.ModuleList(Block(hidden, intermediate, acts[i % len(acts)], bias) for i in range(layers))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.in_proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_toy_model(seed: int = 0, tiled: bool = False, lora: bool = False, dtype=torch.float32, **tile_kwargs) -> ToyModel:
    """A seeded ToyModel; ``tiled`` wraps each block's MLP in TiledMLP(**tile_kwargs)."""
    torch.manual_seed(seed)
    model = ToyModel()
    for layer in model.layers:
        if lora:
            add_lora(layer.mlp)
            for p in (*layer.norm.parameters(), *model.in_proj.parameters(), *model.head.parameters()):
                p.requires_grad_(False)
        if tiled:
            layer.mlp = TiledMLP(layer.mlp, **tile_kwargs)
    # Cast last, so LoRA adapters created above get the dtype too (parameters keep their identity).
    return model.to(dtype)


def residual_stack(make_mlp, hidden: int, intermediate: int, blocks: int = 2) -> nn.Sequential:
    """``blocks`` residual MLPs built by ``make_mlp(hidden, intermediate)`` from seed 0, in float64: the same
    weights on every rank and in the single-process reference."""
    torch.manual_seed(0)
    return nn.Sequential(*(Residual(make_mlp(hidden, intermediate)) for _ in range(blocks))).double()


def regression_batch(seed: int, tokens: int, hidden: int):
    """One rank's ``(x, target)``, ``[1, tokens, hidden]`` in float64, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, hidden, generator=generator, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=generator, dtype=torch.float64)


def regression_loss(model: nn.Module, batch) -> torch.Tensor:
    x, target = batch
    return (model(x) - target).pow(2).mean()


def averaged_grads(model: nn.Module, batches) -> dict:
    """The gradients of the ranks' mean loss, in one process: what data parallelism must deliver."""
    (sum(regression_loss(model, batch) for batch in batches) / len(batches)).backward()
    return {n: p.grad for n, p in model.named_parameters()}
