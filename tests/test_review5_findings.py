"""Review findings on the session that made call plans and the tiled loss hold their module weakly.

Each test states what the library does, measured in float64 against the same module untiled; each failed
before its fix (the review measured the numbers in each test's comment).
"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from reference import falcon_h1_mlp_and_tiled_copy
from torch import nn

from integration_tests.frameworks import need
from integration_tests.tiny_models import grads_by_key, tiny_model, token_batch
from tiled_mlp import TiledMLP, apply_tiled_mlp
from tiled_mlp.core.strict import strict_mode

pytestmark = pytest.mark.timeout(60)

HIDDEN, TOKENS = 8, 16


class TanhChild(nn.Module):
    """The generic path; the activation is a child module, read by the forward as ``self.act``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x)) * 2


class OwnWeight(nn.Module):
    """The generic path, with its parameter on the module itself (not in a child)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


def _two_forwards_child_replaced_between(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Two micro-batches' forwards before their backward, the child activation replaced between them."""
    first = module(x)
    module.act = nn.Sigmoid()
    gc.collect()
    second = module(x)
    gc.collect()
    return first.sum() + second.sum()


def test_strict_mode_refuses_a_child_replaced_before_the_backward_with_a_clear_error():
    # Before: AttributeError from a dead weak reference in the backward (plain values held the child weakly).
    torch.manual_seed(0)
    module = TiledMLP(TanhChild(), num_shards=4)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    with strict_mode(True):
        loss = _two_forwards_child_replaced_between(module, x)
        with pytest.raises(RuntimeError, match="were replaced, added or removed between its forward and backward"):
            loss.backward()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_child_replaced_between_forward_and_backward_is_refused(strict):
    # Untiled, the graph keeps the child the forward ran; before, the recompute ran the new one (grads 16.2 off).
    torch.manual_seed(0)
    module = TiledMLP(TanhChild(), num_shards=4)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    with strict_mode(strict):
        y = module(x)
        module.act = nn.Sigmoid()
        with pytest.raises(RuntimeError, match="were replaced, added or removed between its forward and backward"):
            y.sum().backward()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_generic_module_owning_its_parameters_is_freed_by_its_last_reference(no_collector, strict):
    # Before: the generic layout's parameter slots held the module itself, inside its own plan: a cycle.
    with strict_mode(strict):
        module = TiledMLP(OwnWeight(), num_shards=4)
        for _ in range(2):
            x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
            module(x).sum().backward()
    assert module.tiling.last_path == "generic"
    ref = weakref.ref(module)
    del module, x
    assert ref() is None, "a reference cycle keeps the tiled module alive"


def test_a_shallow_copy_of_a_model_with_the_tiled_loss_runs_after_the_original_is_deleted():
    # Before: TypeError from the pre-hook (the shared forward's model was the deleted original).
    need("transformers")
    ids, labels = token_batch()
    reference = tiny_model("llama")
    reference(input_ids=ids, labels=labels).loss.backward()
    model = tiny_model("llama")
    apply_tiled_mlp(model, num_shards=2, loss=True)
    shallow = copy.copy(model)
    del model
    gc.collect()
    out = shallow(input_ids=ids, labels=labels)
    out.loss.backward()
    expected = grads_by_key(reference)
    got = grads_by_key(shallow)
    # transformers computes the untiled loss in float32; the tiled loss stays in float64.
    assert abs(out.loss.item() - reference(input_ids=ids, labels=labels).loss.item()) < 1e-5
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


# Before: the plan kept the scale's first value, silently: output 0.147 off (down), 0.162 off (gate).
@pytest.mark.parametrize("scale", ["down_multiplier", "gate_multiplier"])
def test_a_named_scale_changed_after_the_first_call_is_used_by_the_fast_path(scale):
    reference, module = falcon_h1_mlp_and_tiled_copy()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    module(x)
    assert module.tiling.last_path == "fast"
    setattr(reference, scale, 0.5)
    setattr(module, scale, 0.5)
    x_ref = x.clone().requires_grad_(True)
    x_tiled = x.clone().requires_grad_(True)
    expected, got = reference(x_ref), module(x_tiled)
    expected.sum().backward()
    got.sum().backward()
    assert module.tiling.last_path == "fast"
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, rtol=0, atol=1e-12)


def test_a_named_scale_changed_after_the_first_compiled_call_is_used():
    # Before: the traced route baked the scale in and guarded nothing on it: 0.147 off.
    reference, module = falcon_h1_mlp_and_tiled_copy()
    compiled = torch.compile(module, backend="eager")
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    compiled(x)
    reference.down_multiplier = module.down_multiplier = 0.5
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=1e-12)


def test_an_activation_mode_changed_after_the_first_call_is_used_by_the_fast_path():
    # Before: the plan kept the activation chosen at the first call: 9.8e-5 off, silently.
    from reference import GatedMLP, seeded

    reference = seeded(GatedMLP, 0, 8, 12, "gelu")
    module = TiledMLP(copy.deepcopy(reference), num_shards=2)
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    module(x)
    assert module.tiling.last_path == "fast"
    reference.act_fn.approximate = module.act_fn.approximate = "tanh"
    torch.testing.assert_close(module(x), reference(x), rtol=0, atol=1e-12)
