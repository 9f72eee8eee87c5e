"""The tiled backward checks what autograd checks for the untiled module.

Untiled, autograd refuses a backward whose saved tensors were modified in place after the forward,
and differentiates twice on request. The tiled backward recomputes from the module as it is at
backward time, so without checks of its own it silently computes with the new weights, the new
conditioning tensor, or returns a gradient that carries no graph (zeros from ``hessian``).
Backends that swap parameter storage between forward and backward (ZeRO-3, FSDP2) are legitimate and
covered by the integration tests, not here.
"""
from __future__ import annotations

import copy

import pytest
import torch
from reference import GatedMLP, assert_runs_close, fresh_inputs, step
from torch import nn

from tiled_mlp import TiledMLP

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 16, 32, 30
SHAPE = (2, TOKENS, HIDDEN)
TOL = 1e-10
INPLACE = "modified by an inplace operation"
CHANGED = "changed between its forward and its backward"

# (path asked for, path expected): a tiny HF LlamaMLP takes the fast path under "auto".
PATHS = [pytest.param("auto", "fast", id="fast"), pytest.param("generic", "generic", id="generic")]


def llama_mlp() -> nn.Module:
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import tiny_model

    return copy.deepcopy(tiny_model("llama").model.layers[0].mlp)


# -- weights and input modified in place between forward and backward ---------------------------------
@pytest.mark.parametrize("path, expect_path", PATHS)
def test_a_weight_modified_in_place_before_backward_raises_as_untiled(path, expect_path):
    mlp = llama_mlp()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=1)

    untiled = copy.deepcopy(mlp)
    y = untiled(x.detach().clone().requires_grad_())
    with torch.no_grad():
        untiled.gate_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.backward(dy)

    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)
    y = tiled(x.detach().clone().requires_grad_())
    assert tiled.tiling.last_path == expect_path
    with torch.no_grad():
        tiled.gate_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE):
        y.backward(dy)


@pytest.mark.parametrize("path, expect_path", PATHS)
def test_the_input_modified_in_place_before_backward_raises_as_untiled(path, expect_path):
    mlp = llama_mlp()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=2)
    for module in (copy.deepcopy(mlp), TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)):
        leaf = x.detach().clone().requires_grad_()
        x2 = leaf * 1
        y = module(x2)
        if isinstance(module, TiledMLP):
            assert module.tiling.last_path == expect_path
        x2.add_(1)
        with pytest.raises(RuntimeError, match=INPLACE):
            y.backward(dy)


# -- a tensor attribute the generic forward reads, changed before backward ----------------------------
class FiLMMLP(GatedMLP):
    """A gated MLP scaled by a conditioning tensor set from outside (a plain attribute, no gradient)."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.cond = torch.rand(INTER, dtype=torch.float64) + 0.5

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * self.cond)


def film(seed: int = 0) -> FiLMMLP:
    torch.manual_seed(seed)
    return FiLMMLP().double()


def new_cond(seed: int) -> torch.Tensor:
    return torch.rand(INTER, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5


def test_a_conditioning_tensor_edited_in_place_before_backward_raises():
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=3)
    untiled = film()
    y = untiled(x.detach().clone().requires_grad_())
    untiled.cond.mul_(3)
    with pytest.raises(RuntimeError, match=INPLACE):  # untiled: the multiply saved it
        y.backward(dy)

    tiled = TiledMLP(film(), num_shards=3)
    y = tiled(x.detach().clone().requires_grad_())
    assert tiled.tiling.last_path == "generic"
    tiled.cond.mul_(3)
    with pytest.raises(RuntimeError, match=CHANGED):
        y.backward(dy)


def test_a_conditioning_tensor_rebound_before_backward_raises():
    """Untiled, the old tensor is saved by the graph; the tiled recompute would read the new one."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=4)
    tiled = TiledMLP(film(), num_shards=3)
    y = tiled(x.detach().clone().requires_grad_())
    tiled.cond = new_cond(1)
    with pytest.raises(RuntimeError, match=CHANGED):
        y.backward(dy)


def test_a_trained_conditioning_tensor_rebound_before_backward_raises():
    """One that needs a gradient: the recompute would read a tensor the Function has no gradient slot for (the old
    one gets a stand-in at each torch call that reads it; the new one is no such call's)."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=4)
    tiled = TiledMLP(film(), num_shards=3)
    tiled.cond = new_cond(1).requires_grad_()
    y = tiled(x.detach().clone().requires_grad_())
    tiled.cond = new_cond(2).requires_grad_()
    with pytest.raises(RuntimeError, match="gradients would be lost"):
        y.backward(dy)


def test_pipeline_schedule_two_forwards_before_two_backwards_raises():
    """A pipeline schedule sets each micro-batch's conditioning, runs both forwards, then both
    backwards: the first micro-batch's recompute would see the second one's conditioning."""
    x1, dy1 = fresh_inputs(SHAPE, HIDDEN, seed=5)
    x2, dy2 = fresh_inputs(SHAPE, HIDDEN, seed=6)
    tiled = TiledMLP(film(), num_shards=3)
    tiled.cond = new_cond(1)
    y1 = tiled(x1.detach().clone().requires_grad_())
    tiled.cond = new_cond(2)
    y2 = tiled(x2.detach().clone().requires_grad_())
    with pytest.raises(RuntimeError, match=CHANGED):
        y2.backward(dy2)
        y1.backward(dy1)


def test_a_conditioning_tensor_unchanged_until_backward_is_exact():
    """The control: nothing changed between forward and backward (the conditioning is rebound only
    between steps) gives the untiled gradients exactly."""
    untiled, tiled = film(), TiledMLP(film(), num_shards=3)
    for seed in (7, 8):
        x, dy = fresh_inputs(SHAPE, HIDDEN, seed=seed)
        want = step(untiled, x, dy)
        got = step(tiled, x, dy)
        assert tiled.tiling.last_path == "generic"
        assert_runs_close(want, got, tol=TOL, context=f"step {seed}")
        untiled.cond = tiled.cond = new_cond(seed)


# -- second-order autograd -------------------------------------------------------------------------------
DOUBLE = "double backward"


def tiny_pair(path: str, expect_path: str):
    """(tiled, untiled, x): the same tiny LlamaMLP weights, and a tiny input."""
    untiled = llama_mlp()
    tiled = TiledMLP(copy.deepcopy(untiled), num_shards=3, path=path)
    x, _ = fresh_inputs((1, 6, HIDDEN), HIDDEN, seed=9, requires_grad=False)
    tiled(x)
    assert tiled.tiling.last_path == expect_path
    return tiled, untiled, x


@pytest.mark.parametrize("path, expect_path", PATHS)
def test_hessian_raises_instead_of_returning_zeros(path, expect_path):
    tiled, untiled, x = tiny_pair(path, expect_path)
    want = torch.autograd.functional.hessian(lambda v: untiled(v).pow(2).sum(), x, vectorize=True)
    assert bool(want.abs().max() > 0), "the untiled Hessian is zero: zeros would not be wrong"
    with pytest.raises(RuntimeError, match=DOUBLE):
        torch.autograd.functional.hessian(lambda v: tiled(v).pow(2).sum(), x)


@pytest.mark.parametrize("path, expect_path", PATHS)
def test_hvp_raises_instead_of_returning_zeros(path, expect_path):
    tiled, untiled, x = tiny_pair(path, expect_path)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    _, want = torch.autograd.functional.hvp(lambda t: untiled(t).pow(2).sum(), x, v)
    assert bool(want.abs().max() > 0)
    with pytest.raises(RuntimeError, match=DOUBLE):
        torch.autograd.functional.hvp(lambda t: tiled(t).pow(2).sum(), x, v)


@pytest.mark.parametrize("path, expect_path", PATHS)
def test_a_gradient_penalty_raises(path, expect_path):
    tiled, untiled, x = tiny_pair(path, expect_path)
    x_ref = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(untiled(x_ref).sum(), x_ref, create_graph=True)
    g.pow(2).sum().backward()  # untiled: a penalty on the input gradient trains the weights
    assert untiled.gate_proj.weight.grad is not None
    x = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=DOUBLE):
        (g,) = torch.autograd.grad(tiled(x).sum(), x, create_graph=True)
        g.pow(2).sum().backward()


# -- frozen weights, retained graphs and a checkpoint's recompute ---------------------------------------
def test_a_frozen_weight_modified_in_place_before_backward_raises_as_untiled():
    """A frozen parameter (a LoRA base weight) is not an input of the tiled Function, but the backward
    recomputes from it all the same."""
    mlp = llama_mlp()
    mlp.up_proj.weight.requires_grad_(False)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=5)
    for module in (copy.deepcopy(mlp), TiledMLP(copy.deepcopy(mlp), num_shards=3, path="generic")):
        y = module(x.detach().clone().requires_grad_())
        with torch.no_grad():
            module.up_proj.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match=INPLACE):
            y.backward(dy)


def test_a_conditioning_edited_between_two_backwards_of_a_retained_graph_raises():
    tiled = TiledMLP(film(), num_shards=3)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=6)
    y = tiled(x.detach().clone().requires_grad_())
    y.backward(dy, retain_graph=True)
    tiled.cond.mul_(3)
    with pytest.raises(RuntimeError, match=CHANGED):
        y.backward(dy)


def test_an_equal_conditioning_rebuilt_by_a_checkpoint_recompute_is_accepted():
    """A parent that sets per-call conditioning (no gradient) before calling the MLP rebuilds an equal
    tensor in a non-reentrant checkpoint's recompute: the same values, so the same gradients."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x, t):
            self.mlp.cond = torch.cos(t * torch.arange(INTER, dtype=torch.float64)) + 2
            return x + self.mlp(x)

    block = Block(film())
    untiled = copy.deepcopy(block)
    TiledMLP(block.mlp, num_shards=3)
    t = torch.tensor(0.3, dtype=torch.float64)
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=7)
    grads = []
    for module in (untiled, block):
        x_in = x.detach().clone().requires_grad_()
        checkpoint(module, x_in, t, use_reentrant=False).pow(2).sum().backward()
        grads.append(x_in.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
