"""A tiled RMSNorm under ``SequenceParallel`` (torchtitan's layout of the norms between the TP regions), run
on each rank of a gloo group on its slice of the sequence, against one process running the whole untiled
norm on the whole sequence (float64): the output, the input gradient and the weight gradient
(``full_tensor()``) at each of two SGD steps, then the weight after them."""
from __future__ import annotations

import copy
from typing import Dict, Sequence

import torch

from .comparison import rel_error
from .tp_cases import reference_steps, tiled_norm_outcome

HIDDEN, BATCH, SEQ, STEPS = 8, 2, 16, 2


class LlamaStyleRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm forward (transformers is not imported: each spawned process stays quick)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.float64))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32 if input_dtype != torch.float64 else input_dtype)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _seeded_norm(kind: str) -> torch.nn.Module:
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6, dtype=torch.float64) if kind == "torch" else LlamaStyleRMSNorm(HIDDEN)
    with torch.no_grad():
        # Not ones: a weight that scales each feature differently (every rank draws the same values).
        norm.weight.copy_(torch.randn(HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(7)))
    return norm


def _norm_step_data(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=generator)
    dy = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=generator)
    return x, dy


def _local(y):
    from torch.distributed.tensor import DTensor

    return y.to_local() if isinstance(y, DTensor) else y


def _run_norm_case(rank: int, world: int, kind: str, use_local_output: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from tiled_mlp.integrations.norms import TiledNorm

    untiled = _seeded_norm(kind)
    reference = reference_steps(copy.deepcopy(untiled), _norm_step_data, STEPS)
    norm = parallelize_module(untiled, init_device_mesh("cpu", (world,)), SequenceParallel(use_local_output=use_local_output))
    TiledNorm(norm, num_shards=3)
    optimizer = torch.optim.SGD(norm.parameters(), lr=0.1)
    tokens = SEQ // world
    mine = slice(rank * tokens, (rank + 1) * tokens)
    errors: Dict[str, float] = {}
    for step in range(STEPS):
        x, dy = _norm_step_data(step)
        x_in = x[:, mine].clone().requires_grad_(True)
        y = _local(norm(x_in))
        (y * dy[:, mine]).sum().backward()
        want = reference[step]
        errors[f"step {step} y"] = rel_error(want["y"][:, mine], y.detach())
        errors[f"step {step} dx"] = rel_error(want["dx"][:, mine], x_in.grad)
        errors[f"step {step} dw"] = rel_error(want["grads"]["weight"], norm.weight.grad.full_tensor())
        optimizer.step()
        optimizer.zero_grad()
    errors["weight after steps"] = rel_error(reference[-1]["params"]["weight"], norm.weight.detach().full_tensor())
    tiling = norm.tiling
    return {"errors": errors, "path": tiling.last_path, "num_shards": tiling.last_num_shards}


def run_norm_cases(rank: int, world: int, cases: Sequence[tuple]) -> dict:
    """Per case (norm kind, use_local_output): the largest relative error of each compared quantity and the
    tiled call's report; or the error the call raised."""
    results = {}
    for case in cases:
        try:
            results[case] = _run_norm_case(rank, world, *case)
        except (RuntimeError, ValueError) as error:
            results[case] = {"raised": str(error)}
    return results


def run_norm_on_2d_mesh(rank: int, world: int) -> str:
    """A tiled RMSNorm whose SequenceParallel weight lives on a 2-D mesh: the error its call raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    norm = _seeded_norm("torch")
    parallelize_module(norm, init_device_mesh("cpu", (world,)), SequenceParallel(use_local_output=True))
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    weight = norm.weight.to_local().detach()
    norm.weight = torch.nn.Parameter(DTensor.from_local(weight, mesh_2d, [Replicate(), Replicate()], run_check=False))
    return tiled_norm_outcome(norm, _norm_step_data(0)[0][:, : SEQ // world])
