"""The generic path (autograd recompute per shard) against the untiled float64 reference."""
from __future__ import annotations

import copy

import pytest
import torch
from reference import (
    GatedMLP,
    PlainMLP,
    Run,
    assert_runs_close,
    fresh_inputs,
    lora_gated,
    run_errors,
    seeded,
    tiled_run,
    untiled_run,
    untiled_shardwise_run,
)

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER = 8, 12
TOKENS = 7  # prime: no shard count > 1 below 7 divides it


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("num_shards", range(1, TOKENS + 3))
@pytest.mark.parametrize("bias", [True, False])
def test_plain_mlp_every_shard_count(batch, num_shards, bias):
    mlp = seeded(PlainMLP, 0, HIDDEN, INTER, bias=bias)
    x, dy = fresh_inputs((batch, TOKENS, HIDDEN), HIDDEN, seed=batch * 100 + num_shards)
    got, tiled = tiled_run(mlp, x, dy, num_shards=num_shards, path="generic")
    assert tiled.tiling.last_path == "generic"
    assert tiled.tiling.last_num_shards == min(num_shards, batch * TOKENS)
    assert_runs_close(untiled_run(mlp, x, dy), got, context=f"batch {batch}, {num_shards} shards")


@pytest.mark.parametrize("shape", [(TOKENS, HIDDEN), (2, 3, 5, HIDDEN)])
def test_two_and_four_dim_inputs(shape):
    mlp = seeded(GatedMLP, 1, HIDDEN, INTER, "gelu", bias=True)
    x, dy = fresh_inputs(shape, HIDDEN, seed=7)
    got, _ = tiled_run(mlp, x, dy, num_shards=4, path="generic")
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_float32_within_a_stated_bound_of_float64():
    mlp = seeded(GatedMLP, 2, HIDDEN, INTER, "silu", dtype=torch.float32)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, dtype=torch.float32, seed=3)
    got, _ = tiled_run(mlp, x, dy, num_shards=3, path="generic")
    errors = run_errors(untiled_run(mlp, x, dy), got)
    assert max(errors.values()) < 1e-5, errors  # float32 rounding (eps 1.2e-7) over sums of <= 14 terms


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 14, 16])
def test_dropout_recompute_sees_the_forward_random_numbers(num_shards):
    mlp = seeded(PlainMLP, 3, HIDDEN, INTER, dropout=0.5)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=11)
    got, _ = tiled_run(mlp, x, dy, seed=42, num_shards=num_shards)
    want = untiled_shardwise_run(mlp, x, dy, num_shards, seed=42)
    other_seed = untiled_shardwise_run(mlp, x, dy, num_shards, seed=43)
    assert not torch.allclose(want.out, other_seed.out), "dropout had no effect: the test could not see a wrong mask"
    assert_runs_close(want, got, context=f"{num_shards} shards")


def test_dropout_one_shard_equals_the_plain_untiled_call_from_the_same_seed():
    mlp = seeded(PlainMLP, 3, HIDDEN, INTER, dropout=0.5)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=12)
    got, _ = tiled_run(mlp, x, dy, seed=5, num_shards=1)
    torch.manual_seed(5)
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_dropout_rng_advances_like_the_untiled_forward():
    """After a tiled forward+backward the global RNG is where the untiled forward leaves it: the
    backward replay restores the caller's state, so training randomness downstream is unchanged."""
    mlp = seeded(PlainMLP, 3, HIDDEN, INTER, dropout=0.5)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN, seed=13)
    tiled_run(mlp, x, dy, seed=9, num_shards=TOKENS)
    after_tiled = torch.rand(4)
    untiled_shardwise_run(mlp, x, dy, TOKENS, seed=9)
    assert torch.equal(after_tiled, torch.rand(4))


@pytest.mark.parametrize("num_shards", [1, 3, 9])
@pytest.mark.parametrize("bias", [True, False])
def test_lora_frozen_base_gets_no_grad(num_shards, bias):
    mlp = seeded(lora_gated, 4, HIDDEN, INTER, "silu", bias=bias)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=17)
    got, tiled = tiled_run(mlp, x, dy, num_shards=num_shards)
    assert tiled.tiling.last_path == "generic"
    want = untiled_run(mlp, x, dy)
    assert_runs_close(want, got)
    frozen = [n for n, g in got.grads.items() if ".base." in n]
    assert frozen and all(got.grads[n] is None for n in frozen)
    assert all(got.grads[n] is not None for n in got.grads if "lora_" in n)


@pytest.mark.parametrize("path", ["generic", "auto"])
def test_input_without_requires_grad(path):
    mlp = seeded(GatedMLP, 5, HIDDEN, INTER, "silu", bias=True)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=19, requires_grad=False)
    got, _ = tiled_run(mlp, x, dy, num_shards=3, path=path)
    assert got.dx is None
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_everything_frozen_and_no_input_grad_gives_an_output_without_graph():
    mlp = seeded(GatedMLP, 5, HIDDEN, INTER, "silu").requires_grad_(False)
    from tiled_mlp import TiledMLP

    x, _ = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN, requires_grad=False)
    out = TiledMLP(mlp, num_shards=3, path="generic")(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, mlp(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["generic", "fast"])
def test_existing_grad_is_accumulated_into(path):
    """Micro-batch accumulation: a second backward adds to the first one's ``.grad``."""
    from tiled_mlp import TiledMLP

    mlp = seeded(GatedMLP, 6, HIDDEN, INTER, "silu", bias=True)
    x1, dy1 = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=21)
    x2, dy2 = fresh_inputs((1, 5, HIDDEN), HIDDEN, seed=22)
    want1, want2 = untiled_run(mlp, x1, dy1), untiled_run(mlp, x2, dy2)
    tiled = TiledMLP(mlp, num_shards=3, path=path)
    tiled(x1).backward(dy1)
    tiled(x2).backward(dy2)
    for name, p in tiled.named_parameters():
        expected = want1.grads[name] + want2.grads[name]
        torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12, msg=name)


# -- how training code calls it -------------------------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_under_activation_checkpointing(use_reentrant):
    """Gradient checkpointing (HF's) reruns the tiled forward: same random numbers, same grads."""
    from torch.utils.checkpoint import checkpoint

    from tiled_mlp import TiledMLP

    mlp = seeded(PlainMLP, 7, HIDDEN, INTER, dropout=0.3)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=23)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    x_in = x.detach().clone().requires_grad_()
    torch.manual_seed(3)
    out = checkpoint(tiled, x_in, use_reentrant=use_reentrant)
    out.backward(dy)
    got = Run(out.detach(), x_in.grad, {n: p.grad for n, p in tiled.named_parameters()})
    assert_runs_close(untiled_shardwise_run(mlp, x, dy, 3, seed=3), got)


def test_called_twice_in_one_graph():
    """Weight sharing: each call keeps its own saved state; grads of both calls add up once each."""
    from tiled_mlp import TiledMLP

    mlp = seeded(GatedMLP, 8, HIDDEN, INTER, "silu", bias=True)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=24)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    x_in = x.detach().clone().requires_grad_()
    tiled(tiled(x_in)).backward(dy)
    x_ref = x.detach().clone().requires_grad_()
    mlp(mlp(x_ref)).backward(dy)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(tiled.named_parameters(), mlp.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_autocast_recompute_runs_under_the_forward_autocast():
    """Forward under bf16 autocast, backward outside it (as training loops do): the generic recompute
    must replay the forward's autocast, so grads match the untiled autocast run within bf16 rounding
    (measured ~4e-3) instead of an fp32 recompute's activations."""
    from tiled_mlp import TiledMLP

    mlp = seeded(GatedMLP, 9, HIDDEN, INTER, "silu", dtype=torch.float32)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, dtype=torch.float32, seed=25)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    ref = copy.deepcopy(mlp)
    x_tiled, x_ref = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_tiled = tiled(x_tiled)
        out = ref(x_ref)
    out_tiled.backward(dy.to(out_tiled.dtype))
    out.backward(dy.to(out.dtype))
    got = Run(out_tiled.detach(), x_tiled.grad, {n: p.grad for n, p in tiled.named_parameters()})
    want = Run(out.detach(), x_ref.grad, {n: p.grad for n, p in ref.named_parameters()})
    assert tiled.tiling.last_path == "generic" and got.out.dtype == torch.bfloat16
    errors = run_errors(want, got)
    assert errors["out"] == 0.0
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.parametrize("path", ["generic", "fast"])
def test_backward_under_an_autocast_the_forward_did_not_have(path):
    """Forward in fp32, ``backward()`` called inside an autocast block (older AMP loops do this): the
    recompute must stay fp32, like the forward, and match the fp32 reference."""
    mlp = seeded(GatedMLP, 12, HIDDEN, INTER, "silu", dtype=torch.float32)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, dtype=torch.float32, seed=27)
    from tiled_mlp import TiledMLP

    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)
    x_in = x.detach().clone().requires_grad_()
    out = tiled(x_in)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out.backward(dy)
    got = Run(out.detach(), x_in.grad, {n: p.grad for n, p in tiled.named_parameters()})
    errors = run_errors(untiled_run(mlp, x, dy), got)
    assert max(errors.values()) < 1e-5, errors


def test_no_grad_and_empty_inputs():
    from tiled_mlp import TiledMLP

    mlp = seeded(GatedMLP, 10, HIDDEN, INTER, "silu")
    tiled = TiledMLP(mlp, num_shards=3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), mlp(x), rtol=1e-12, atol=1e-12)
    empty = torch.zeros(0, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = tiled(empty)
    out.sum().backward()
    assert out.shape == (0, TOKENS, HIDDEN) and tiled.tiling.last_path == "untiled"


class _Box:
    pass


class CycleLeavingMLP(PlainMLP):
    """A forward that leaves a reference cycle holding one of its tensors (the collector frees it, nothing
    keeps it): the kept-tensor check collects once before it refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        box = _Box()
        box.tensor, box.me = y * 2, box
        return y


def test_a_reference_cycle_left_by_the_forward_is_collected_not_refused():
    import gc

    module = seeded(CycleLeavingMLP, 0, HIDDEN, INTER)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(module, x, dy)
    gc.disable()  # the cycle must be there when the shard ends, as between two automatic collections
    try:
        have, _ = tiled_run(module, x, dy, num_shards=3, path="generic")
    finally:
        gc.enable()
    assert_runs_close(want, have)


def test_a_weight_a_parametrization_cache_keeps_across_shards_is_refused_by_name():
    # parametrize.cached() around the call keeps the weight the first shard computed for the whole call
    # (PEFT's LoRA on target_parameters turns it on around the model's forward): refused, naming the cache.
    from torch.nn.utils import parametrize

    from tiled_mlp import TiledMLP

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

        def forward(self, weight):
            return weight * self.factor

    mlp = GatedMLP(8, 12).double()
    parametrize.register_parametrization(mlp.up_proj, "weight", Scaled())
    tiled = TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    tiled(x).sum().backward()  # without the cache: the generic kernel, every shard computing the weight anew
    assert tiled.tiling.last_path == "generic"
    with parametrize.cached(), pytest.raises(RuntimeError, match=r"parametrize\.cached\(\) was on"):
        tiled(x)


class _ReadsAViewOfItsWeight(torch.nn.Module):
    """Its forward reads a view of its own weight made before the call (an attribute set once, as a module that
    slices a stacked expert weight ahead of its forward does)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, INTER, dtype=torch.float64))
        self.out = torch.nn.Linear(INTER, HIDDEN, dtype=torch.float64)

    def forward(self, x):
        return self.out(torch.relu(x @ self.view))


def test_a_view_of_a_parameter_made_before_the_call_gives_that_parameter_its_gradient():
    from tiled_mlp import TiledMLP

    torch.manual_seed(4)
    plain = _ReadsAViewOfItsWeight()
    tiled = TiledMLP(copy.deepcopy(plain), num_shards=3, path="generic")
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    grads = []
    for module in (plain, tiled):
        module.view = module.weight[:, :]  # made outside the call: not a tensor the call makes
        x_in = x.detach().clone().requires_grad_()
        out = module(x_in)
        out.backward(dy)
        grads.append([out, x_in.grad, *(p.grad for p in module.parameters())])
    assert tiled.tiling.last_path == "generic"
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
