"""Compiled training with tiled MLPs under FSDP2 (and DDP): two gloo processes on CPU, float64.

As torchtitan runs it: each decoder block compiled on its own (``torch.compile(block, fullgraph=True)``,
``aot_eager``), then ``fully_shard`` on each compiled block and on the root; FSDP2's hooks unshard the
parameters outside the compiled block, so the traced tiled MLP sees plain tensors and becomes one
``tiled_mlp::gated_mlp`` node (``tiled_core/compiled_route.py``). DDP: the model with compiled blocks inside
``DistributedDataParallel``.

Each case trains 3 steps on different data per rank and must equal the untiled, uncompiled model trained
in one process on the concatenated batches (``compile_cases.reference_run``): the mean of the ranks'
losses, every full gradient and every full parameter after every step, within ``compile_cases.BOUND``.
It must also have run the op: no graph break (``fullgraph`` raises at one; Dynamo's break counter stays
empty), one Dynamo graph per block over all steps (no retrace as FSDP2 reshards), the op once in each
forward graph and its backward op once in each backward graph, and each tiled MLP's report saying so.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from .compile_cases import BOUND, CASES, NUM_SHARDS, CompileCase, reference_run
from .compile_training import train_compiled
from .dynamo_versions import traced_as_ops
from .spawn import run_distributed

pytestmark = [pytest.mark.distributed, traced_as_ops]

WORLD = 2
OP, BACKWARD_OP = "tiled_mlp.gated_mlp.default", "tiled_mlp.gated_mlp_backward.default"
MATMULS = (["mm"], ["addmm"], ["bmm"], ["matmul"])  # "aten.mm.default" -> ["mm"]


def _rel(want: torch.Tensor, have: torch.Tensor) -> float:
    if want.shape != have.shape:
        return float("inf")
    return ((have - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def relative_errors(ref: Dict, ranks: List[Dict]) -> Dict[str, float]:
    """``{what: max|have - want| / max|want|}``: the ranks' mean loss, every gradient, every parameter, per step."""
    out = {}
    for step in range(len(ref["losses"])):
        mean_loss = sum(r["losses"][step] for r in ranks) / len(ranks)
        out[f"step {step} loss"] = _rel(ref["losses"][step], mean_loss)
        for kind in ("grads", "params"):
            want, have = ref[kind][step], ranks[0][kind][step]
            assert want.keys() == have.keys(), f"parameters differ: {sorted(want)} vs {sorted(have)}"
            out.update({f"step {step} {kind} {name}": _rel(want[name], have[name]) for name in want})
    return out


def check_op_ran(case: CompileCase, rank: int, record: Dict) -> None:
    where = f"{case.name}, rank {rank}"
    assert record["graph_breaks"] == {}, f"{where}: graph breaks {record['graph_breaks']}"
    graphs = record["graphs"]
    # One graph per block for all the steps: nothing retraced the block (FSDP2's resharding included).
    assert len(graphs) == case.blocks, f"{where}: {len(graphs)} Dynamo graphs for {case.blocks} blocks"
    for graph in graphs:
        assert graph["dynamo"].count(OP) == 1, f"{where}: Dynamo graph without the op: {graph['dynamo']}"
        assert graph["forward"].count(OP) == 1, f"{where}: AOT forward: {graph['forward']}"
        assert graph["backward"].count(BACKWARD_OP) == 1, f"{where}: AOT backward: {graph['backward']}"
        if case.model == "toy":  # the block's only Linears are the MLP's: none may be traced as a matmul
            matmuls = [t for t in graph["forward"] + graph["backward"] if t.split(".")[1:2] in MATMULS]
            assert not matmuls, f"{where}: the MLP traced as matmuls: {matmuls}"
    assert len(record["tiled"]) == case.blocks, where
    for tiled in record["tiled"]:
        assert tiled["path"] == "fast" and tiled["num_shards"] == NUM_SHARDS, (where, tiled)
        assert "tiled_mlp::gated_mlp" in (tiled["compiled_reason"] or ""), (where, tiled)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_tiled_training_equals_untiled_reference(name, tmp_path, record_property):
    case = CASES[name]
    ranks = run_distributed(train_compiled, WORLD, tmp_path, case, timeout=50)
    ref = reference_run(case, WORLD)
    # Not vacuous: the reference trains every parameter.
    assert all((ref["params"][-1][n] != p).any() for n, p in ref["initial"].items()), name
    for rank, record in enumerate(ranks):
        check_op_ran(case, rank, record)
        assert all((record["initial"][n] == p).all() for n, p in ref["initial"].items()), (name, rank)
        # Every rank holds the same full parameters and gradients after the collectives.
        for kind in ("grads", "params"):
            assert all((ranks[0][kind][s][n] == t).all() for s, step in enumerate(record[kind])
                       for n, t in step.items()), (name, rank, kind)
    errors = relative_errors(ref, ranks)
    worst = max(errors, key=errors.get)
    record_property("worst relative error", f"{errors[worst]:.2e} ({worst})")
    print(f"{name}: worst relative error {errors[worst]:.2e} ({worst})")
    failures = [f"{what}: {err:.3g} > {BOUND:g}" for what, err in errors.items() if not err <= BOUND]
    assert not failures, f"{name}:\n" + "\n".join(failures)
