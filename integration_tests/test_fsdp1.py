"""FSDP1 (``FullyShardedDataParallel``) is rejected with an error that names FSDP1 and the fix
(FSDP2 ``fully_shard``): at the first forward of a model wrapped after tiling, and at construction
when the MLP is already under FSDP1. Two gloo processes on CPU (``device_id=torch.device("cpu")``)."""
from __future__ import annotations

import pytest
import torch

from .spawn import run_distributed
from .toy_models import make_toy_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

WORLD = 2


def _error_of(fn) -> dict:
    """Run ``fn``; return what it raised (type name, message) and whether it raised at all."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test inspects whatever it was
        from tiled_mlp import UnsupportedBackendError

        return {"raised": True, "unsupported": isinstance(error, UnsupportedBackendError),
                "type": type(error).__name__, "message": str(error)}
    return {"raised": False}


def fsdp1_ranks_main(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from tiled_mlp import TiledMLP

    cpu = torch.device("cpu")
    out = {}
    for orig in (False, True):
        # Tiled first, then the whole model wrapped: caught at the first forward.
        model = make_toy_model(seed=0, tiled=True, num_shards=3)
        wrapped = FSDP(model, device_id=cpu, use_orig_params=orig)
        grads_before = [p.grad for p in wrapped.parameters()]
        out[f"forward orig={orig}"] = _error_of(lambda w=wrapped: w(torch.randn(2, 5, 16)))
        out[f"forward orig={orig} grads untouched"] = all(
            g is None for g in grads_before + [p.grad for p in wrapped.parameters()])

        # A forward before wrapping (a sanity check, a warm-up) must not pin the single-device
        # strategy: FSDP1 would then drop every gradient silently.
        model = make_toy_model(seed=0, tiled=True, num_shards=3)
        model(torch.randn(2, 5, 16))
        wrapped = FSDP(model, device_id=cpu, use_orig_params=orig)
        out[f"forward after warm-up orig={orig}"] = _error_of(lambda w=wrapped: w(torch.randn(2, 5, 16)))

        # Tiled per block, each block its own FSDP unit (the usual auto-wrap layout).
        model = make_toy_model(seed=0, tiled=True, num_shards=3)
        for index, layer in enumerate(model.layers):
            model.layers[index] = FSDP(layer, device_id=cpu, use_orig_params=orig)
        wrapped = FSDP(model, device_id=cpu, use_orig_params=orig)
        out[f"per-block forward orig={orig}"] = _error_of(lambda w=wrapped: w(torch.randn(2, 5, 16)))

        # Already under FSDP1, then tiled: caught at construction.
        model = make_toy_model(seed=0)
        mlp_unit = FSDP(model.layers[0].mlp, device_id=cpu, use_orig_params=orig)
        out[f"construct on FSDP1 mlp orig={orig}"] = _error_of(lambda m=mlp_unit: TiledMLP(m))
        model = make_toy_model(seed=0)
        FSDP(model, device_id=cpu, use_orig_params=orig)
        out[f"construct inside FSDP1 model orig={orig}"] = _error_of(lambda m=model: TiledMLP(m.layers[1].mlp, num_shards=2))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(fsdp1_ranks_main, WORLD, tmp_path_factory.mktemp("fsdp1"), timeout=100)


def test_every_fsdp1_layout_is_rejected_with_the_fix_named(ranks):
    for rank, results in enumerate(ranks):
        for what, result in results.items():
            if what.endswith("grads untouched"):
                assert result, f"rank {rank}: {what}"
                continue
            assert result["raised"], f"rank {rank}: {what} did not raise"
            assert result["unsupported"], f"rank {rank}: {what} raised {result['type']}: {result['message']}"
            assert "FSDP1" in result["message"] and "fully_shard" in result["message"], result["message"]
            assert "FSDP2" in result["message"], result["message"]


def test_all_cases_ran(ranks):
    assert len(ranks) == WORLD
    assert len(ranks[0]) == 12
