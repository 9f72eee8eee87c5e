"""The gated fast path (SwiGLU, GEGLU exact and tanh, fused gate_up_proj) and the path chooser."""
from __future__ import annotations

import types

import pytest
import torch
from reference import (
    ACTS,
    FusedGatedMLP,
    GatedMLP,
    PlainMLP,
    assert_runs_close,
    fresh_inputs,
    lora_gated,
    run_errors,
    seeded,
    tiled_run,
    untiled_run,
)
from torch import nn

from tiled_mlp import TiledMLP

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 8, 12, 7
BUILDERS = {"separate": GatedMLP, "fused": FusedGatedMLP}


@pytest.mark.parametrize("layout", BUILDERS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch, num_shards", [(1, 1), (1, 3), (2, 5), (3, 21), (2, 16)])
def test_fast_path_matches_float64_reference(layout, act, bias, batch, num_shards):
    mlp = seeded(BUILDERS[layout], 0, HIDDEN, INTER, act, bias=bias)
    x, dy = fresh_inputs((batch, TOKENS, HIDDEN), HIDDEN, seed=num_shards)
    got, tiled = tiled_run(mlp, x, dy, num_shards=num_shards, path="fast")
    assert tiled.tiling.last_path == "fast"
    assert_runs_close(untiled_run(mlp, x, dy), got, context=f"{layout} {act} bias={bias}")


@pytest.mark.parametrize("layout", BUILDERS)
@pytest.mark.parametrize("act", ACTS)
def test_fast_and_generic_agree_in_float32(layout, act):
    mlp = seeded(BUILDERS[layout], 1, HIDDEN, INTER, act, bias=True, dtype=torch.float32)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, dtype=torch.float32, seed=5)
    fast, t1 = tiled_run(mlp, x, dy, num_shards=4, path="fast")
    generic, t2 = tiled_run(mlp, x, dy, num_shards=4, path="generic")
    assert (t1.tiling.last_path, t2.tiling.last_path) == ("fast", "generic")
    errors = run_errors(generic, fast)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("layout", BUILDERS)
def test_fast_path_without_input_grad(layout):
    mlp = seeded(BUILDERS[layout], 2, HIDDEN, INTER, "silu", bias=True)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=6, requires_grad=False)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3, path="fast")
    assert got.dx is None and tiled.tiling.last_path == "fast"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_fast_path_with_a_frozen_projection():
    mlp = seeded(GatedMLP, 3, HIDDEN, INTER, "silu", bias=True)
    mlp.up_proj.requires_grad_(False)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=8)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert got.grads["up_proj.weight"] is None and got.grads["up_proj.bias"] is None
    assert_runs_close(untiled_run(mlp, x, dy), got)


# -- the chooser ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", BUILDERS)
def test_auto_picks_fast_for_a_plain_gated_mlp(layout):
    mlp = seeded(BUILDERS[layout], 4, HIDDEN, INTER, "gelu_tanh")
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=2)
    assert tiled.tiling.last_path == "fast"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_auto_picks_generic_for_lora():
    mlp = seeded(lora_gated, 4, HIDDEN, INTER, "silu")
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=2)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def _double_output(module, inputs, output):
    return output * 2


def test_auto_picks_generic_for_a_hooked_projection_and_the_hook_takes_effect():
    mlp = seeded(GatedMLP, 5, HIDDEN, INTER, "silu")
    mlp.gate_proj.register_forward_hook(_double_output)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_hooks_the_fast_kernel_would_skip_send_auto_to_generic():
    """A recording hook on ``act_fn`` and a full backward hook on a projection must fire (the fast
    kernel calls neither module); the generic path runs them per shard."""
    mlp = seeded(GatedMLP, 5, HIDDEN, INTER, "silu")
    forward_seen, backward_seen = [], []
    mlp.act_fn.register_forward_hook(lambda m, a, out: forward_seen.append(tuple(out.shape[:-1])))
    mlp.down_proj.register_full_backward_hook(lambda m, gi, go: backward_seen.append(tuple(go[0].shape[:-1])))
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "generic"
    shards = [(1, 5), (1, 5), (1, 4)]
    assert forward_seen == shards * 2  # forward, then the backward recompute
    assert backward_seen == shards
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_hooks_on_the_mlp_itself_keep_the_fast_path_and_fire_once():
    mlp = seeded(GatedMLP, 5, HIDDEN, INTER, "silu")
    seen = []
    mlp.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    tiled = TiledMLP(mlp, num_shards=3)
    tiled(x).backward(dy)
    assert tiled.tiling.last_path == "fast" and seen == [(2, TOKENS, HIDDEN)]


class SwappedGatedMLP(GatedMLP):
    """Gated names, but ``act(up) * gate``: the numerical probe must notice and refuse the fast path."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_auto_picks_generic_when_the_forward_is_not_the_formula():
    mlp = seeded(SwappedGatedMLP, 6, HIDDEN, INTER, "silu")
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), got)


class ClampedGatedMLP(GatedMLP):
    """The gated formula except for large gate values: a probe near zero alone cannot tell."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=4.0) * self.up_proj(x))


def test_auto_picks_generic_when_the_forward_differs_only_for_large_values():
    mlp = seeded(ClampedGatedMLP, 6, HIDDEN, INTER, "silu")
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    x = (x * 8).detach().requires_grad_()  # inputs large enough for the clamp to matter here too
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_a_forward_replaced_on_a_projection_sends_auto_to_generic():
    """accelerate's device/offload hooks replace ``module.forward`` on the instance; the fast kernel
    would bypass it, so the generic path runs it (here it scales the projection's output)."""
    mlp = seeded(GatedMLP, 7, HIDDEN, INTER, "silu")
    # A bound method, so that the deep copies the reference and tiled runs make keep their own.
    mlp.up_proj.forward = types.MethodType(lambda self, inp: 2.0 * nn.Linear.forward(self, inp), mlp.up_proj)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(mlp, x, dy)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(want, got)


def _lora():
    return lora_gated(HIDDEN, INTER)


def _hooked():
    mlp = GatedMLP(HIDDEN, INTER)
    mlp.gate_proj.register_forward_hook(_double_output)
    return mlp


def _act_hooked():
    mlp = GatedMLP(HIDDEN, INTER)
    mlp.act_fn.register_forward_hook(lambda m, a, out: None)
    return mlp


def _backward_hooked():
    mlp = GatedMLP(HIDDEN, INTER)
    mlp.up_proj.register_full_backward_hook(lambda m, gi, go: None)
    return mlp


@pytest.mark.parametrize("builder", [lambda: PlainMLP(HIDDEN, INTER), _lora, _hooked, _act_hooked, _backward_hooked,
                                     lambda: SwappedGatedMLP(HIDDEN, INTER),
                                     lambda: PlainMLP(HIDDEN, INTER, dropout=0.1)],
                         ids=["not-gated", "lora", "hooked", "act-hooked", "backward-hooked", "not-the-formula", "dropout"])
def test_path_fast_on_an_unsuitable_module_raises_before_any_work(builder):
    """Refused when tiling is asked for, with the module left as it was: its class, no tiling state,
    nothing run, and its plain forward still works."""
    torch.manual_seed(0)
    mlp = builder().double()
    cls = type(mlp)
    before = {n: p.detach().clone() for n, p in mlp.named_parameters()}
    calls = []
    mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    for child in mlp.children():
        child.register_forward_pre_hook(lambda m, a: calls.append(2))
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="path='fast'"):
        TiledMLP(mlp, num_shards=2, path="fast")
    assert type(mlp) is cls and "tiling" not in mlp.__dict__
    assert all(p.grad is None for p in mlp.parameters())
    assert all(torch.equal(before[n], p) for n, p in mlp.named_parameters())
    assert torch.equal(rng, torch.get_rng_state())
    assert calls == []  # decided by what the module is: nothing ran
    mlp(torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64))


def test_changing_the_path_after_a_fast_call_is_honoured():
    """The cached decision is keyed on the tiling's own configuration too: asking for the generic path
    after a fast call must run the generic path (and the result stays exact)."""
    mlp = seeded(GatedMLP, 6, HIDDEN, INTER, "silu")
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(mlp, x, dy)
    tiled = TiledMLP(mlp, num_shards=3)
    tiled(x.detach())
    assert tiled.tiling.last_path == "fast"
    tiled.tiling.path = "generic"
    x_in = x.detach().clone().requires_grad_()
    tiled(x_in).backward(dy)
    assert tiled.tiling.last_path == "generic"
    torch.testing.assert_close(x_in.grad, want.dx, rtol=1e-10, atol=0)
