"""Small modules and the untiled float64 reference that the core's unit tests compare against.

Every comparison runs the same weights twice: untiled in float64 (the reference) and tiled through
``TiledMLP``, on fresh random inputs and a fresh random output gradient, then checks the output, the
input gradient and every parameter gradient. Modules are deep-copied, so the two runs never share a
``.grad``.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

# A process of its own started in tests/ (test_registry.py's) imports this module with only tests/ on its
# path: the repository root, where the shared toy modules live, goes after everything else.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from integration_tests.toy_models import GatedMLP, LoRALinear, make_act  # noqa: E402
from tiled_mlp import Strategy, TiledMLP, register_gated_mlp
from tiled_mlp.core.shard_plan import make_shard_plan

ACTS = ("silu", "gelu", "gelu_tanh")


class FusedGatedMLP(nn.Module):
    """Phi3 style: one ``gate_up_proj`` whose output is chunked into gate and up."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.activation_fn = make_act(act)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.activation_fn(gate) * up)


# Not the body Phi-3 writes, so declared: the fast path takes a forward only on proof (gated_forms.py).
register_gated_mlp(FusedGatedMLP, gate=None, up=None, gate_up="gate_up_proj", activation="activation_fn")


class PlainMLP(nn.Module):
    """GPT-2 style ``fc2(dropout(gelu(fc1(x))))``: generic path only (not gated)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = True, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        self.fc2 = nn.Linear(intermediate, hidden, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.dropout(F.gelu(self.fc1(x))))


def lora_gated(hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> GatedMLP:
    mlp = GatedMLP(hidden, intermediate, act, bias)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, name, LoRALinear(getattr(mlp, name)))
    return mlp


def seeded(builder, seed: int, *args, dtype=torch.float64, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return builder(*args, **kwargs).to(dtype)


@dataclass
class Run:
    """What one forward+backward produced."""

    out: torch.Tensor
    dx: Optional[torch.Tensor]
    grads: Dict[str, Optional[torch.Tensor]]


def param_grads(module: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """Parameter name -> a copy of its gradient (None where there is none)."""
    return {name: (None if p.grad is None else p.grad.detach().clone()) for name, p in module.named_parameters()}


def _collect(module: nn.Module, out, x) -> Run:
    return Run(out.detach(), None if x.grad is None else x.grad.detach().clone(), param_grads(module))


def step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, *, keyword: str = "",
         seed: Optional[int] = None) -> Run:
    """One forward+backward of ``module`` as it is (tiled or not), from fresh grads, on a leaf copy of ``x``
    passed by position or by ``keyword``; ``seed`` seeds torch's generator just before the forward."""
    for p in module.parameters():
        p.grad = None
    x_in = x.detach().clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    out = module(**{keyword: x_in}) if keyword else module(x_in)
    out.backward(dy)
    return _collect(module, out, x_in)


def fresh_inputs(shape, hidden_out: int, dtype=torch.float64, seed: int = 1234, requires_grad: bool = True):
    """A random input and a random output gradient (not ones: ones would hide a transposed gradient)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
    dy = torch.randn(*shape[:-1], hidden_out, generator=generator, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad), dy


def untiled_run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype=torch.float64) -> Run:
    """The module as it is, on a float64 copy of everything: the reference."""
    ref = copy.deepcopy(module).to(dtype)
    x_ref = x.detach().to(dtype).requires_grad_(x.requires_grad)
    out = ref(x_ref)
    out.backward(dy.to(dtype))
    return _collect(ref, out, x_ref)


def untiled_shardwise_run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, num_shards: int, seed: int) -> Run:
    """The untiled module applied to the tiled plan's token shards one after another, from ``seed``.

    For a module that draws random numbers (dropout) this is the reference the tiled run must match:
    the same random stream, consumed shard by shard as the tiled forward consumes it.
    """
    ref = copy.deepcopy(module).to(torch.float64)
    x_ref = x.detach().to(torch.float64).requires_grad_(x.requires_grad)
    flat = x_ref.reshape(-1, x_ref.shape[-1])
    plan = make_shard_plan(flat.shape[0], num_shards)
    torch.manual_seed(seed)
    out = torch.cat([ref(flat[s].unsqueeze(0)).squeeze(0) for s in plan.slices()]).view(*x.shape[:-1], -1)
    out.backward(dy.to(torch.float64))
    return _collect(ref, out, x_ref)


def tiled_run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, seed: Optional[int] = None, **tile_kwargs):
    """A deep copy of ``module`` wrapped in ``TiledMLP(**tile_kwargs)``; returns (Run, the TiledMLP)."""
    tiled = TiledMLP(copy.deepcopy(module), **tile_kwargs)
    x_in = x.detach().clone().requires_grad_(x.requires_grad)
    if seed is not None:
        torch.manual_seed(seed)
    out = tiled(x_in)
    out.backward(dy)
    return _collect(tiled, out, x_in), tiled


def laid_out(t: torch.Tensor, memory: str) -> torch.Tensor:
    """``t``'s values in another memory layout: ``"transposed"`` swaps the strides of the first two dims (an
    input ``[batch, tokens, hidden]`` made from ``[tokens, batch, hidden]``; a column-major weight)."""
    if memory == "contiguous":
        return t
    return t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(t.requires_grad)


def max_rel_error(want: torch.Tensor, have: torch.Tensor) -> float:
    """``max|have - want| / max(max|want|, tiny)``, in float64."""
    want, have = want.double(), have.double()
    assert want.shape == have.shape, f"shape {tuple(have.shape)} != {tuple(want.shape)}"
    return float((have - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def run_errors(want: Run, have: Run) -> Dict[str, float]:
    """Relative error of the output, the input gradient and every parameter gradient."""
    errors = {"out": max_rel_error(want.out, have.out)}
    assert (want.dx is None) == (have.dx is None), f"input grad presence differs: {want.dx is None} vs {have.dx is None}"
    if want.dx is not None:
        errors["dx"] = max_rel_error(want.dx, have.dx)
    assert want.grads.keys() == have.grads.keys()
    for name, ref in want.grads.items():
        got = have.grads[name]
        assert (ref is None) == (got is None), f"{name}: grad presence differs (reference {ref is not None}, tiled {got is not None})"
        if ref is not None:
            errors[f"grad {name}"] = max_rel_error(ref, got)
    return errors


def assert_runs_close(want: Run, have: Run, tol: float = 1e-10, context: str = "") -> None:
    errors = run_errors(want, have)
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"{context}: relative errors above {tol:g}: {bad}"


class ClaimsNothing(Strategy):
    """A strategy subclass with ``claims``, its one abstract method, and nothing else: the base of the
    registration and contract tests' cases."""

    @classmethod
    def claims(cls, module, ancestors=()):
        return False


def falcon_h1_mlp_and_tiled_copy(seed: int = 0):
    """transformers' FalconH1MLP in float64 (two named multipliers, down_multiplier and gate_multiplier), and a
    tiled deep copy of it with 2 shards."""
    from integration_tests.frameworks import need

    need("transformers")
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    config = FalconH1Config(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(seed)
    reference = FalconH1MLP(config).double()
    return reference, TiledMLP(copy.deepcopy(reference), num_shards=2)
