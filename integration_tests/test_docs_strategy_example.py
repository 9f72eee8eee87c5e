"""docs/architecture.md's strategy example (``ManualDataParallel``), run verbatim on 2 gloo ranks with the
default settings (``num_shards="auto"``): a strategy that delivers gradients itself sees every call.

The inputs are far too short for the auto policy to tile: the calls still go through the tiled Function (as
one shard), so ``deliver_grads`` all-reduces on every rank, and the gradients equal the float64 reference of
the whole global batch. Where the ranks' policies disagree (one rank would tile, the other not), both still
deliver, with no deadlock.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Union

import pytest
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.strategies import unregister_strategy

from .spawn import run_distributed
from .toy_models import GatedMLP, averaged_grads, regression_batch, regression_loss, residual_stack

pytestmark = pytest.mark.distributed

WORLD = 2
HIDDEN, INTER = 8, 20
TOKENS = (5, 9)  # per rank
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def example_code() -> str:
    """The Python block of the docs' "Adding a strategy" section, as it is written there."""
    section = DOCS.read_text().split("## Adding a strategy", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "docs/architecture.md's strategy section has no python example"
    return match.group(1)


def _docs_model() -> nn.Module:
    return residual_stack(GatedMLP, HIDDEN, INTER)


def _docs_batch(rank: int):
    return regression_batch(200 + rank, TOKENS[rank], HIDDEN)


def docs_example_ranks(rank: int, world_size: int, disagree: bool) -> Dict[str, object]:
    exec(compile(example_code(), str(DOCS), "exec"), {})  # defines and registers ManualDataParallel
    # The defaults (strategy="auto", num_shards="auto"); where the ranks disagree, rank 1 tiles its calls in 2.
    num_shards: Union[int, str] = 2 if disagree and rank == 1 else "auto"
    try:
        model = _docs_model()
        for p in model.parameters():
            p._manual_dp = True  # type: ignore[attr-defined]  # the example's claims reads this mark
        tiled = [TiledMLP(block.mlp, num_shards=num_shards) for block in model]
        regression_loss(model, _docs_batch(rank)).backward()
        return {
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "strategies": [m.tiling.last_strategy.name for m in tiled],
            "paths": [m.tiling.last_path for m in tiled],
            "shards": [m.tiling.last_num_shards for m in tiled],
            "reasons": [m.tiling.last_reason for m in tiled],
        }
    finally:
        unregister_strategy("manual_dp")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("disagree", [False, True], ids=["same_policy", "ranks_disagree"])
def test_the_docs_strategy_example_delivers_on_every_call(tmp_path, disagree):
    ranks = run_distributed(docs_example_ranks, WORLD, tmp_path, disagree, timeout=60)
    want = averaged_grads(_docs_model(), [_docs_batch(rank) for rank in range(WORLD)])
    for rank, got in enumerate(ranks):
        for name, reference in want.items():
            error = float((got["grads"][name] - reference).abs().max() / reference.abs().max())
            assert error <= 1e-12, f"rank {rank} {name}: relative error {error:.3g}"
        assert got["strategies"] == ["manual_dp"] * 2, got["strategies"]
        assert got["paths"] == ["fast"] * 2, (rank, got["paths"])
        if disagree and rank == 1:
            assert got["shards"] == [2] * 2, got["reasons"]
        else:  # too short to tile: one shard
            assert got["shards"] == [1] * 2 and all("run as one shard" in r for r in got["reasons"]), got["reasons"]
