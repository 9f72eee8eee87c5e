"""A parallel backend the package does not ship, added through ``register_strategy`` alone.

The backend: plain data parallelism with no wrapper module. Each rank holds whole parameters and
marks them as its own (as ZeRO marks its parameters with ``ds_id``); nothing reduces gradients but
the strategy itself, which all-reduces each tiled call's summed gradients in ``deliver_grads``.
``TiledMLP(..., strategy="auto")`` must resolve it from its own ``claims``, and on both ranks the
gradients must equal the single-process float64 reference of the whole global batch. Ranks see
different token counts (so different shard counts): the strategy issues one all-reduce per
parameter per backward, never one per shard, so they cannot deadlock.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.strategies import Strategy, WaitsForEveryParameter, claims_need_process_group, register_strategy

from .spawn import run_distributed
from .toy_models import GatedMLP, add_lora, averaged_grads, regression_batch, regression_loss, residual_stack

pytestmark = pytest.mark.distributed

WORLD = 2
HIDDEN, INTER = 8, 20
TOKENS = (11, 23)  # per rank: unequal, so each rank picks its own shard count
MARK = "_manual_dp"


class ManualDataParallel(WaitsForEveryParameter, Strategy):
    """Every rank brings a gradient for every parameter (``WaitsForEveryParameter``: zeros for an
    unused one), so every rank issues the same all-reduces."""

    name = "test_manual_dp"
    priority = 500
    delivers_grads = True

    @classmethod
    @claims_need_process_group  # asked only where one is initialised, as here
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return any(getattr(p, MARK, False) for p in module.parameters())

    def deliver_grads(self, params: Sequence[torch.Tensor],
                      grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        for grad in grads:
            if grad is not None:
                dist.all_reduce(grad)
                grad /= dist.get_world_size()
        return grads


def _manual_dp_model(kind: str) -> nn.Module:
    """Two residual gated MLPs: plain (the fast path), or with LoRA adapters and a parameter the forward
    never reads (the generic path; frozen bases get no gradient, the unused one zeros)."""
    return residual_stack(GatedMLP if kind == "fast" else _lora_mlp, HIDDEN, INTER)


def _lora_mlp(hidden: int, intermediate: int) -> nn.Module:
    mlp = add_lora(GatedMLP(hidden, intermediate))
    mlp.unused = nn.Parameter(torch.ones(3))
    return mlp


def _manual_dp_batch(rank: int):
    return regression_batch(100 + rank, TOKENS[rank], HIDDEN)


def manual_dp_ranks(rank: int, world_size: int) -> Dict[str, dict]:
    register_strategy(ManualDataParallel)
    out = {}
    for kind in ("fast", "generic"):
        model = _manual_dp_model(kind)
        for p in model.parameters():
            setattr(p, MARK, True)  # the backend's own bookkeeping
        # strategy="auto" (the default): resolved from the registered class's own claims.
        tiled = [TiledMLP(block.mlp, num_shards=2 + rank) for block in model]
        regression_loss(model, _manual_dp_batch(rank)).backward()
        out[kind] = {
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "strategies": [m.tiling.last_strategy.name for m in tiled],
            "paths": [m.tiling.last_path for m in tiled],
            "shards": [m.tiling.last_num_shards for m in tiled],
        }
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(manual_dp_ranks, WORLD, tmp_path_factory.mktemp("manual_dp"), timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fast", "generic"])
def test_registered_backend_is_resolved_and_reduces_gradients_exactly(ranks, kind):
    want = averaged_grads(_manual_dp_model(kind), [_manual_dp_batch(rank) for rank in range(WORLD)])
    for rank, result in enumerate(ranks):
        got = result[kind]
        assert got["strategies"] == ["test_manual_dp"] * 2, got["strategies"]
        assert got["paths"] == [kind] * 2 and got["shards"] == [2 + rank] * 2, (got["paths"], got["shards"])
        assert got["grads"].keys() == want.keys()
        for name, reference in want.items():
            have = got["grads"][name]
            if name.endswith(".unused"):  # None untiled; zeros from a backend that waits for every one
                assert reference is None and have is not None and not have.any(), name
                continue
            assert (reference is None) == (have is None), f"rank {rank} {name}: gradient presence differs"
            if reference is not None:
                error = float((have - reference).abs().max() / reference.abs().max())
                assert error <= 1e-12, f"rank {rank} {name}: relative error {error:.3g}"
