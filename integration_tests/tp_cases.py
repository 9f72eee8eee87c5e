"""A tiled SwiGLU MLP under DTensor tensor parallelism (``parallelize_module``), run on each rank of a gloo
group, against one process running the whole untiled, unparallelized MLP (float64).

Two layouts: ``replicate`` (gate/up ``ColwiseParallel``, down ``RowwiseParallel``: every rank holds every
token) and ``sequence`` (torchtitan's: ``PrepareModuleInput(Shard(1) -> Replicate)`` on the MLP and
``RowwiseParallel(output_layouts=Shard(1))`` on down: each rank holds its slice of the sequence in and out).
Each step compares the output, the input gradient and every parameter gradient (``full_tensor()``), then
takes an SGD step; the parameters after the last step are compared too.
"""
from __future__ import annotations

import copy
from typing import Dict, Sequence, Tuple, Union

import torch

from .comparison import rel_error

HIDDEN, INTERMEDIATE, BATCH, SEQ, STEPS = 8, 12, 2, 12, 2


class TPGatedMLP(torch.nn.Module):
    """A SwiGLU MLP with Llama's names (transformers is not imported: each spawned process stays quick),
    declared to the fast kernel with ``register_gated_mlp``."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=bias, dtype=torch.float64)
        self.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=bias, dtype=torch.float64)
        self.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=bias, dtype=torch.float64)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(torch.nn.Module):
    """GPT-2's MLP (``c_fc``, tanh GELU, ``c_proj``, with biases): no gated form, so only the generic kernel (the
    module's own forward per shard) runs it."""

    def __init__(self, intermediate: int = INTERMEDIATE):
        super().__init__()
        self.c_fc = torch.nn.Linear(HIDDEN, intermediate, dtype=torch.float64)
        self.c_proj = torch.nn.Linear(intermediate, HIDDEN, dtype=torch.float64)
        self.act = torch.nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


def gated_mlp(bias: bool = False) -> torch.nn.Module:
    from tiled_mlp import register_gated_mlp

    register_gated_mlp(TPGatedMLP)
    torch.manual_seed(0)
    return TPGatedMLP(bias)


def tp_plan(layout: str) -> Dict[str, object]:
    """The ``parallelize_module`` plan of each layout the tests cover."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    sequence_input = {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    if layout in ("replicate", "down_bias"):
        return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    if layout == "sequence_input":  # sequence-sharded input, replicated output
        return {**sequence_input, "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel()}
    if layout == "sequence":  # torchtitan's: sequence-sharded input and output
        return {**sequence_input, "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel(output_layouts=Shard(1))}
    if layout == "sequence_negative":  # the same, the sequence dim counted from the end
        return {"": PrepareModuleInput(input_layouts=(Shard(-2),), desired_input_layouts=(Replicate(),)),
                "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel(output_layouts=Shard(-2))}
    if layout in ("gelu", "gelu_stashed"):  # the generic kernel's own: a module with no gated form
        return {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    if layout == "gelu_hidden_input":  # each rank holds a slice of the hidden dim, which c_fc's hook gathers
        return {"c_fc": ColwiseParallel(input_layouts=Shard(-1)), "c_proj": RowwiseParallel()}
    if layout == "gelu_uneven":  # rows split unevenly: only DTensor activations keep their global shape
        return {"c_fc": ColwiseParallel(use_local_output=False), "c_proj": RowwiseParallel()}
    if layout == "gelu_dtensor_output":  # the module hands a DTensor on, which no tiled call returns
        return {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel(use_local_output=False)}
    if layout == "dtensor_activations":  # gate and up hand DTensors on: a layout the local view does not prove
        return {"gate_proj": ColwiseParallel(use_local_output=False), "up_proj": ColwiseParallel(use_local_output=False),
                "down_proj": RowwiseParallel()}
    raise ValueError(layout)


SEQUENCE_SHARDED_INPUT = ("sequence_input", "sequence", "sequence_negative")
SEQUENCE_SHARDED_OUTPUT = ("sequence", "sequence_negative")


def step_data(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=generator)
    weight = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.float64, generator=generator)  # a non-uniform dy
    return x, weight


def reference_steps(module: torch.nn.Module, data=None, steps: int = STEPS) -> list:
    """``steps`` SGD steps of ``module`` in one process on ``data(step)`` (x and the output's weight; this file's
    data by default): each step's output, input gradient and parameter gradients, then the parameters after them."""
    data = data or step_data
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    found = []
    for step in range(steps):
        x, weight = data(step)
        x.requires_grad_(True)
        y = module(x)
        (y * weight).sum().backward()
        found.append({"y": y.detach(), "dx": x.grad, "grads": {n: p.grad.clone() for n, p in module.named_parameters()}})
        optimizer.step()
        optimizer.zero_grad()
    found.append({"params": {n: p.detach().clone() for n, p in module.named_parameters()}})
    return found


def _run_mlp_case(rank: int, world: int, layout: str, path: str, num_shards: Union[int, str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tiled_mlp import TiledMLP

    if layout.startswith("gelu"):
        torch.manual_seed(0)
        untiled = GeluMLP(UNEVEN_INTERMEDIATE if layout == "gelu_uneven" else INTERMEDIATE)
    else:
        untiled = gated_mlp(bias=layout == "down_bias")
    reference = reference_steps(copy.deepcopy(untiled))
    mesh = init_device_mesh("cpu", (world,))
    mlp = parallelize_module(untiled, mesh, tp_plan(layout))
    if layout == "gelu_stashed":  # after the style's own output hook: it is handed the shard's reduced output
        stash = []
        mlp.c_proj.register_forward_hook(lambda module, inputs, output: stash.append(output))
    TiledMLP(mlp, num_shards=num_shards, path=path)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    tokens = SEQ // world
    local_in = slice(rank * tokens, (rank + 1) * tokens) if layout in SEQUENCE_SHARDED_INPUT else slice(None)
    local_out = slice(rank * tokens, (rank + 1) * tokens) if layout in SEQUENCE_SHARDED_OUTPUT else slice(None)
    width = HIDDEN // world
    local_hidden = slice(rank * width, (rank + 1) * width) if layout == "gelu_hidden_input" else slice(None)
    errors: Dict[str, float] = {}
    for step in range(STEPS):
        x, weight = step_data(step)
        x_in = x[:, local_in, local_hidden].clone().requires_grad_(True)
        y = mlp(x_in)
        (y * weight[:, local_out]).sum().backward()
        want = reference[step]
        errors[f"step {step} y"] = rel_error(want["y"][:, local_out], y.detach())
        errors[f"step {step} dx"] = rel_error(want["dx"][:, local_in, local_hidden], x_in.grad)
        for name, p in mlp.named_parameters():
            errors[f"step {step} grad {name}"] = rel_error(want["grads"][name], p.grad.full_tensor())
        optimizer.step()
        optimizer.zero_grad()
    tiling = mlp.tiling
    sizes = tiling.call_plan
    return {"errors": errors, "path": tiling.last_path, "reason": tiling.last_reason, "num_shards": tiling.last_num_shards,
            "intermediate": sizes.intermediate, "param_bytes": sizes.param_bytes, "pending_works": _pending_works()}


# Over 2 ranks, 7 rows on one and 6 on the other.
UNEVEN_INTERMEDIATE = 13


def run_uneven_auto(rank: int, world: int) -> dict:
    """The GELU MLP with an intermediate size that does not split evenly, ``num_shards="auto"``, the policy's
    constants set so that it tiles these few tokens with one shard per ``392 // (8 * rows)`` tokens: 4 shards of
    the 24 tokens for 7 rows, 3 for 6. Ranks holding 7 and 6 rows must still run the same count of shards, and
    so of all-reduces: each sizes them for the largest share, 7 rows."""
    from tiled_mlp.core import auto_shards

    auto_shards.MIN_SAVED_BYTES = auto_shards.MIN_INTERMEDIATE_SHARE = 0
    auto_shards.MIN_TOKENS_PER_SHARD = 1
    auto_shards.WORKING_SET_SHARE = 1e9
    auto_shards.SHARD_INTERMEDIATE_BYTES = 392
    auto_shards.estimated_saved_bytes = lambda num_tokens, size, num_shards: 1.0  # tiling pays, at any size
    return run_tp_cases(rank, world, [("gelu_uneven", "auto")], num_shards="auto")["gelu_uneven", "auto"]


def _pending_works() -> int:
    """Collectives whose work c10d's functional registry still holds (never waited for)."""
    from torch._C._distributed_c10d import _get_work_registry_size

    return _get_work_registry_size()


def run_tp_cases(rank: int, world: int, cases: Sequence[Tuple[str, str]], num_shards: Union[int, str] = 3) -> dict:
    """Per case (layout, path), on this rank: the largest relative error of each compared quantity, and
    the tiled call's report; or the error the call raised."""
    results = {}
    for layout, path in cases:
        try:
            results[layout, path] = _run_mlp_case(rank, world, layout, path, num_shards)
        except (RuntimeError, ValueError, TypeError) as error:
            results[layout, path] = {"raised": str(error)}
    return results


def run_norm_refusal(rank: int, world: int) -> str:
    """A tiled RMSNorm under ``SequenceParallel`` (computed on the rank's tokens: ``tp_norm_cases.py``): the
    error tiling it or its call raises, or what it returned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    norm = torch.nn.RMSNorm(HIDDEN, dtype=torch.float64)
    parallelize_module(norm, init_device_mesh("cpu", (world,)), SequenceParallel(use_local_output=True))
    return tiled_norm_outcome(norm, step_data(0)[0][:, : SEQ // world])


def tiled_norm_outcome(norm: torch.nn.Module, x: torch.Tensor) -> str:
    """Tile ``norm`` (2 shards) and call it on ``x``: the error either raises, or what the call returned."""
    from tiled_mlp.integrations.norms import TiledNorm

    try:
        TiledNorm(norm, num_shards=2)
        y = norm(x.clone().requires_grad_(True))
    except (RuntimeError, ValueError) as error:
        return f"raised: {error}"
    return f"returned {tuple(y.shape)} through {norm.tiling.last_path}"


def run_tp_refusals(rank: int, world: int, cases: Sequence[Tuple[str, str]]) -> dict:
    """``run_tp_cases`` for ``cases``, and the tiled norm under ``SequenceParallel`` as ``"norm"``."""
    return {**run_tp_cases(rank, world, cases), "norm": run_norm_refusal(rank, world)}
