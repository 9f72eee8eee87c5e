"""Layouts a reviewer found the tensor-parallel local view mishandles, run on each rank of a gloo group
against one process running the whole untiled MLP (float64), with ``tp_cases.py``'s harness."""
from __future__ import annotations

import copy
from typing import Dict

from .comparison import rel_error
from .tp_cases import SEQ, gated_mlp, reference_steps, step_data


def _tp_plan(layout: str) -> Dict[str, object]:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if layout == "colwise_sequence_input":  # gate and up gather a sequence-sharded plain input themselves
        return {"gate_proj": ColwiseParallel(input_layouts=Shard(1)), "up_proj": ColwiseParallel(input_layouts=Shard(1)),
                "down_proj": RowwiseParallel(output_layouts=Shard(1))}
    raise ValueError(layout)


def run_review_case(rank: int, world: int, layout: str, num_shards: int) -> dict:
    """One step on this rank (``num_shards=0``: the module untiled, the harness's own check): the largest
    relative error of each compared quantity, or the error the call raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from tiled_mlp import TiledMLP

    untiled = gated_mlp()
    reference = reference_steps(copy.deepcopy(untiled))
    mlp = parallelize_module(untiled, init_device_mesh("cpu", (world,)), _tp_plan(layout))
    if num_shards:
        TiledMLP(mlp, num_shards=num_shards, path="fast")
    tokens = SEQ // world
    local = slice(rank * tokens, (rank + 1) * tokens)
    errors: Dict[str, float] = {}
    try:
        x, weight = step_data(0)
        x_in = x[:, local].clone().requires_grad_(True)
        y = mlp(x_in)
        (y * weight[:, local]).sum().backward()
        want = reference[0]
        errors["y"] = rel_error(want["y"][:, local], y.detach())
        errors["dx"] = rel_error(want["dx"][:, local], x_in.grad)
        for name, p in mlp.named_parameters():
            errors[f"grad {name}"] = rel_error(want["grads"][name], p.grad.full_tensor())
    except (RuntimeError, ValueError, AssertionError) as error:
        return {"raised": str(error)}
    return {"errors": errors, "path": getattr(getattr(mlp, "tiling", None), "last_path", "untiled")}
