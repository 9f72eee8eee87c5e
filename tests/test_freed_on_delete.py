"""A tiled model is freed when its last reference goes, as the untiled one is: tiling makes no reference cycle.

A cycle (a call plan in the module's state holding the module, a closure holding itself) keeps the whole
model, and its accelerator memory, alive after ``del model`` until the garbage collector happens to run:
``del model; torch.cuda.empty_cache()`` between runs (sweeps, evaluation, a reference model dropped) would
then load the next model beside the old one. Each test runs with the collector off, so only reference counts
free anything.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from reference import GatedMLP, PlainMLP, seeded
from torch import nn

from integration_tests.frameworks import need
from integration_tests.tiny_models import FAMILIES, token_batch
from tiled_mlp import TiledMLP, apply_tiled_mlp
from tiled_mlp.core.strict import strict_mode

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 8, 12, 16


@pytest.fixture
def no_collector():
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _train_step(module: nn.Module) -> None:
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("kind,path", [("gated", "fast"), ("plain", "generic")])
def test_a_tiled_module_is_freed_by_its_last_reference(no_collector, kind, path, strict):
    module = seeded(GatedMLP, 0, HIDDEN, INTER, "silu") if kind == "gated" else seeded(PlainMLP, 0, HIDDEN, INTER)
    with strict_mode(strict):
        tiled = TiledMLP(module, num_shards=4)
        _train_step(tiled)
        _train_step(tiled)  # a warm call, on the kept plan
    assert tiled.tiling.last_path == path
    module_ref, weight_ref = weakref.ref(tiled), weakref.ref(next(tiled.parameters()))
    del tiled, module
    assert module_ref() is None and weight_ref() is None, "a reference cycle keeps the tiled module alive"


@pytest.mark.parametrize("options", [None, dict(), dict(loss=True, norms=True)],
                         ids=["untiled", "mlp", "mlp+loss+norms"])
def test_a_model_tiled_by_apply_tiled_mlp_is_freed_by_its_last_reference(no_collector, options):
    # Built as the family builds it: ``tiny_model``'s attention switch leaves cycles of transformers' own, and
    # the untiled case shows this flow has none.
    need("transformers")
    model = FAMILIES["llama"].build()
    if options is not None:
        apply_tiled_mlp(model, num_shards=2, **options)
    ids, labels = token_batch()
    model(input_ids=ids, labels=labels).loss.backward()
    model_ref = weakref.ref(model)
    mlp_weight_ref = weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    del model
    assert model_ref() is None and mlp_weight_ref() is None, "a reference cycle keeps the model alive"


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_a_module_deleted_before_its_backward_still_backpropagates_exactly(kind, strict):
    # The graph keeps what the backward recomputes with, as autograd's keeps what it saved.
    build = (lambda: seeded(GatedMLP, 0, HIDDEN, INTER, "silu")) if kind == "gated" else (
        lambda: seeded(PlainMLP, 0, HIDDEN, INTER))
    reference = build()
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    with strict_mode(strict):
        tiled = TiledMLP(build(), num_shards=4)
        weight = next(tiled.parameters())
        y = tiled(x)
        del tiled
        gc.collect()
        y.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, next(reference.parameters()).grad, rtol=0, atol=1e-12)
