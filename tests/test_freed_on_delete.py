"""A tiled model is freed when its last reference goes, as the untiled one is: tiling makes no reference cycle.

A cycle (a call plan in the module's state holding the module, a closure holding itself) keeps the whole
model, and its accelerator memory, alive after ``del model`` until the garbage collector happens to run:
``del model; torch.cuda.empty_cache()`` between runs (sweeps, evaluation, a reference model dropped) would
then load the next model beside the old one. Each test runs with the collector off, so only reference counts
free anything.
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from reference import GatedMLP, PlainMLP, seeded
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from integration_tests.frameworks import need
from integration_tests.tiny_models import FAMILIES, token_batch
from tiled_mlp import TiledMLP, apply_long_context, apply_tiled_mlp
from tiled_mlp.core import dynamo_support
from tiled_mlp.core.strict import strict_mode
from tiled_mlp.integrations.offload import apply_checkpoint_offload, checkpointing_on

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("llama_built_once")]

HIDDEN, INTER, TOKENS = 8, 12, 16


def _mlp_train_step(module: nn.Module) -> None:
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("kind,path", [("gated", "fast"), ("plain", "generic")])
def test_a_tiled_module_is_freed_by_its_last_reference(no_collector, kind, path, strict):
    module = seeded(GatedMLP, 0, HIDDEN, INTER, "silu") if kind == "gated" else seeded(PlainMLP, 0, HIDDEN, INTER)
    with strict_mode(strict):
        tiled = TiledMLP(module, num_shards=4)
        _mlp_train_step(tiled)
        _mlp_train_step(tiled)  # a warm call, on the kept plan
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


def _checkpointed_llama(layers: str) -> nn.Module:
    model = FAMILIES["llama"].build()
    model.train()
    if layers == "wrapper":
        decoder_layers = model.model.layers
        for index, layer in enumerate(decoder_layers):
            decoder_layers[index] = checkpoint_wrapper(layer)
    else:
        checkpointing_on(model)
    return model


@pytest.mark.parametrize("offload", [False, True], ids=["untiled", "offload"])
@pytest.mark.parametrize("layers", ["hf", "hf_call_site", "wrapper"])
def test_a_model_with_checkpoint_offload_is_freed_by_its_last_reference(no_collector, monkeypatch, layers, offload):
    """The offload's hooks on the layers hold it; it holds the layers weakly. ``hf_call_site``: transformers 5.6's
    layers, which checkpoint around their own hooks (forced here, as tests/test_offload_call_site.py does): the
    offload hooks a call site in each layer's checkpoint function, and undoing that holds the layers weakly too."""
    need("transformers")
    from tiled_mlp.integrations.seams import transformers_internals

    if layers == "hf_call_site":
        monkeypatch.setattr(transformers_internals, "checkpoint_wraps_module_hooks", lambda: True)
    model = _checkpointed_llama(layers)
    handle = apply_checkpoint_offload(model) if offload else None
    ids, labels = token_batch()
    # No cache: transformers 5.6 fills one in training, and a wrapped layer's recompute would extend it again.
    model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
    if handle is not None:
        assert handle.host_bytes.peak > 0 and len(handle.layers) == 2  # it offloaded
    model_ref, layer_weight_ref = weakref.ref(model), weakref.ref(next(model.model.layers[0].parameters()))
    del model, handle
    assert model_ref() is None and layer_weight_ref() is None, "a reference cycle keeps the model alive"


@pytest.mark.parametrize("then", ["kept", "removed"])
def test_a_model_under_the_long_context_stack_is_freed_by_its_last_reference(no_collector, then):
    need("transformers")
    model = FAMILIES["llama"].build()
    model.train()
    stack = apply_long_context(model, num_shards=2, loss_num_shards=2)  # MLPs, norms, loss, checkpoint offload
    ids, labels = token_batch()
    model(input_ids=ids, labels=labels).loss.backward()
    assert stack.offload is not None and stack.offload.host_bytes.peak > 0
    if then == "removed":
        stack.remove()
        model(input_ids=ids, labels=labels).loss.backward()
    model_ref, layer_weight_ref = weakref.ref(model), weakref.ref(next(model.model.layers[0].parameters()))
    del model, stack
    assert model_ref() is None and layer_weight_ref() is None, "a reference cycle keeps the model alive"


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_a_compiled_tiled_module_is_freed_once_dynamo_is_reset(no_collector, tiled):
    """Dynamo's caches hold a compiled module until ``torch._dynamo.reset()``; after it, nothing the tiled call's
    tracing left behind does (it reads no ``__dict__`` in traced code: ``compiled_route._watched``)."""
    torch._dynamo.reset()
    module = seeded(GatedMLP, 0, HIDDEN, INTER, "silu")
    if tiled:
        TiledMLP(module, num_shards=4)
    compiled = torch.compile(module, backend="aot_eager")
    _mlp_train_step(compiled)
    if tiled and dynamo_support.TRACES_TILED_CALLS:  # before torch 2.9: the eager call behind a graph break
        assert module.tiling.last_path == "fast" and "tiled_mlp::gated_mlp" in module.tiling.compiled_reason
    module_ref, weight_ref = weakref.ref(module), weakref.ref(next(module.parameters()))
    torch._dynamo.reset()
    del module, compiled
    assert module_ref() is None and weight_ref() is None, "a reference cycle keeps the compiled module alive"


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_a_deep_copy_of_a_tiled_model_is_freed_by_its_last_reference(no_collector, tiled):
    """The copy's tiled loss holds the copy weakly, as the original's holds the original (``TiledLossForward``'s
    ``__deepcopy__``: strongly only where the forward is copied alone)."""
    need("transformers")
    model = FAMILIES["llama"].build()
    if tiled:
        apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
    clone = copy.deepcopy(model)
    ids, labels = token_batch()
    clone(input_ids=ids, labels=labels).loss.backward()
    clone_ref, weight_ref = weakref.ref(clone), weakref.ref(clone.model.layers[0].mlp.up_proj.weight)
    del clone
    assert clone_ref() is None and weight_ref() is None, "a reference cycle keeps the copy alive"


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
