"""Rank side of ``test_fsdp2_compile``: tile the model, compile each block (torchtitan's order: compile, then
shard), wrap it in FSDP2 or DDP, train, and record every loss, full gradient and full parameter, what each
tiled MLP reports, and every graph the compiler was given.

The graphs are recorded by a backend that is ``aot_eager`` (Dynamo, then AOT autograd's forward and
backward graphs, run without code generation) with a note of each graph's operators: the test reads there
that each block traced once, and that the tiled MLP is one ``tiled_mlp::gated_mlp`` node forward and one
``tiled_mlp::gated_mlp_backward`` node backward.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from tiled_mlp import TiledMLP, apply_tiled_mlp

from .compile_cases import (
    NUM_SHARDS,
    STEPS,
    CompileCase,
    base_model,
    batch,
    blocks_of,
    canonical,
    loss_of,
    make_optimizer,
)


def recording_backend(graphs: List[Dict[str, List[str]]]) -> Callable:
    """``aot_eager``, noting into ``graphs`` the operators of each Dynamo graph and of its AOT forward and
    backward graphs (the backward one is compiled at the first backward)."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def targets(gm: torch.fx.GraphModule) -> List[str]:
        return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]

    def backend(gm: torch.fx.GraphModule, example_inputs):
        entry = {"dynamo": targets(gm)}
        graphs.append(entry)

        def noting(kind: str):
            def compiler(graph, inputs):
                entry[kind] = targets(graph)
                return boxed_nop(graph, inputs)
            return compiler

        return aot_eager(gm, example_inputs, fw_compiler=noting("forward"), bw_compiler=noting("backward"))

    return backend


def tile(case: CompileCase, model: nn.Module) -> None:
    if case.model == "toy":
        for layer in model.layers:
            layer.mlp = TiledMLP(layer.mlp, num_shards=NUM_SHARDS)
    else:
        report = apply_tiled_mlp(model, num_shards=NUM_SHARDS)
        assert len(report.patched) == len(blocks_of(case, model)), report


def build(case: CompileCase, world_size: int, graphs: List) -> nn.Module:
    model = base_model(case)
    tile(case, model)
    blocks = blocks_of(case, model)
    backend = recording_backend(graphs)
    for index, block in enumerate(blocks):
        # fullgraph: a graph break anywhere in the block (the tiled MLP included) is an error at trace time.
        blocks.register_module(str(index), torch.compile(block, backend=backend, fullgraph=True))
    if case.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 DTensor (a collective: every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train_compiled(rank: int, world_size: int, case: CompileCase) -> Dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs: List[Dict[str, List[str]]] = []
    model = build(case, world_size, graphs)
    named = [(canonical(n), p) for n, p in model.named_parameters()]
    optimizer = make_optimizer(case, [p for _, p in named])
    record: Dict = {"losses": [], "grads": [], "params": [], "initial": {n: full(p) for n, p in named}}
    for step in range(STEPS):
        loss = loss_of(case, model, batch(case, rank, step))
        loss.backward()
        record["losses"].append(loss.detach().clone())
        record["grads"].append({n: full(p.grad) for n, p in named})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: full(p) for n, p in named})
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record["tiled"] = [{"path": m.tiling.last_path, "num_shards": m.tiling.last_num_shards,
                        # Set where the call is traced only (compiled_route): absent, the call was never traced.
                        "compiled_reason": getattr(m.tiling, "compiled_reason", None)} for m in tiled]
    record["graphs"] = graphs
    record["graph_breaks"] = {reason: count for reason, count in counters["graph_break"].items()}
    dist.barrier()
    return record
