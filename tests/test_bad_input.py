"""Bad arguments fail with a clear error before any work, and a failure mid-step leaves nothing behind."""
from __future__ import annotations

import pytest
import torch
from reference import ClaimsNothing, GatedMLP, PlainMLP, fresh_inputs, seeded, untiled_run, untiled_shardwise_run

from tiled_mlp import Strategy, TiledMLP, register_strategy
from tiled_mlp.core import untile
from tiled_mlp.strategies.registry import available_strategies

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 8, 12, 7


def snapshot(mlp):
    return {n: p.detach().clone() for n, p in mlp.named_parameters()}


def assert_untouched(mlp, before, x=None):
    assert all(p.grad is None for p in mlp.parameters()), "a .grad was written"
    assert all(torch.equal(before[n], p) for n, p in mlp.named_parameters()), "a parameter changed"
    if x is not None:
        assert x.grad is None


@pytest.mark.parametrize("bad, error, match", [
    (0, ValueError, ">= 1"), (-3, ValueError, ">= 1"), ("many", ValueError, "'auto'"),
    (True, TypeError, "bool"), (1.5, TypeError, "float"), (None, TypeError, "NoneType"),
])
def test_bad_num_shards_at_construction(bad, error, match):
    mlp = GatedMLP(HIDDEN, INTER)
    with pytest.raises(error, match=match):
        TiledMLP(mlp, num_shards=bad)


def test_bad_num_shards_set_later_is_refused_at_once():
    mlp = seeded(GatedMLP, 0, HIDDEN, INTER)
    tiled = TiledMLP(mlp, num_shards=2)
    before = snapshot(mlp)
    with pytest.raises(ValueError, match="num_shards"):
        tiled.tiling.num_shards = 0
    assert tiled.tiling.num_shards == 2
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert_untouched(mlp, before, x)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"path": "fastest"}, ValueError, "path must be one of"),
    ({"grad_accum_dtype": torch.int32}, TypeError, "grad_accum_dtype"),
    ({"strategy": 3}, TypeError, "strategy must be"),
    ({"use_fused_kernel": "no"}, TypeError, "use_fused_kernel must be True or False"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    mlp = GatedMLP(HIDDEN, INTER)
    with pytest.raises(error, match=match):
        TiledMLP(mlp, **kwargs)
    assert type(mlp) is GatedMLP and "tiling" not in vars(mlp), "refused, yet tiled"


def test_a_switch_set_to_a_string_is_refused():
    tiled = TiledMLP(GatedMLP(HIDDEN, INTER))
    with pytest.raises(TypeError, match="use_fused_kernel must be True or False"):
        tiled.tiling.use_fused_kernel = "no"
    assert tiled.tiling.use_fused_kernel is True


def test_wrapping_twice_or_wrapping_a_non_module():
    with pytest.raises(TypeError, match="already tiled"):
        TiledMLP(TiledMLP(GatedMLP(HIDDEN, INTER)))
    with pytest.raises(TypeError, match="nn.Module"):
        TiledMLP(lambda x: x)


@pytest.mark.parametrize("make_x, error, match", [
    (lambda: torch.randn(HIDDEN, dtype=torch.float64), ValueError, "2 dims or more"),
    (lambda: torch.tensor(1.0, dtype=torch.float64), ValueError, "2 dims or more"),
    (lambda: torch.randn(2, TOKENS, HIDDEN + 1, dtype=torch.float64), ValueError, f"expects {HIDDEN}"),
    (lambda: torch.ones(2, TOKENS, HIDDEN, dtype=torch.int64), TypeError, "floating-point"),
    (lambda: [[0.0] * HIDDEN], TypeError, "tensor input"),
])
@pytest.mark.parametrize("builder", [GatedMLP, PlainMLP])
def test_bad_input_fails_before_any_work(make_x, error, match, builder):
    mlp = seeded(builder, 0, HIDDEN, INTER)
    calls = []
    # Tiled in place, the module's own hooks fire before its forward checks the input, as untiled;
    # none of its submodules may run.
    for child in mlp.children():
        child.register_forward_pre_hook(lambda m, a: calls.append(1))
    tiled = TiledMLP(mlp, num_shards=2)
    before = snapshot(mlp)
    with pytest.raises(error, match=match):
        tiled(make_x())
    assert calls == [], "a submodule was called"
    assert_untouched(mlp, before)


def test_unknown_strategy_name_lists_the_available_ones():
    with pytest.raises(KeyError, match="available strategies") as info:
        TiledMLP(GatedMLP(HIDDEN, INTER), strategy="no_such_backend")
    assert all(name in str(info.value) for name in available_strategies())
    assert "single_device" in str(info.value)




def test_register_strategy_rejects_bad_classes():
    class NotAStrategy:
        name = "not_a_strategy"

    class Nameless(ClaimsNothing):
        pass

    class Duplicate(ClaimsNothing):
        name = "single_device"

    class NoClaims(Strategy):
        name = "no_claims"

    with pytest.raises(TypeError, match="subclass of tiled_mlp.Strategy"):
        register_strategy(NotAStrategy)
    with pytest.raises(TypeError, match="subclass of tiled_mlp.Strategy"):
        register_strategy(Duplicate())  # an instance, not a class
    with pytest.raises(TypeError, match="non-empty class attribute `name`"):
        register_strategy(Nameless)
    with pytest.raises(ValueError, match="override=True"):
        register_strategy(Duplicate)
    with pytest.raises(TypeError, match="must define claims"):
        register_strategy(NoClaims)

    class WrongArity(ClaimsNothing):
        name = "wrong_arity"
        gathers_params = True

        def gathered(self):  # the core calls gathered(module)
            return None

    class InstanceClaims(ClaimsNothing):
        name = "instance_claims"

        def claims(self, module, ancestors=()):
            return True

    class ClaimsIsNotAMethod(ClaimsNothing):
        name = "claims_flag"
        claims = True

    with pytest.raises(TypeError, match=r"gathered must accept \(module\)"):
        register_strategy(WrongArity)
    with pytest.raises(TypeError, match="claims must be a classmethod"):
        register_strategy(InstanceClaims)
    with pytest.raises(TypeError, match="claims is not a method"):
        register_strategy(ClaimsIsNotAMethod)
    assert not {"wrong_arity", "instance_claims", "claims_flag", "no_claims"} & set(available_strategies())
    assert "not_a_strategy" not in available_strategies()
    from tiled_mlp.strategies import SingleDeviceStrategy
    from tiled_mlp.strategies.registry import get_strategy_class

    assert get_strategy_class("single_device") is SingleDeviceStrategy


# -- failures mid-step ----------------------------------------------------------------------------
class FailsOnRecompute(PlainMLP):
    """Raises from its forward once ``armed``: armed between forward and backward, the failure
    happens inside the backward recompute of the generic path."""

    armed = False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("boom from inside the wrapped module")
        return super().forward(x)


@pytest.mark.parametrize("preexisting_grad", [False, True])
def test_error_in_backward_recompute_propagates_and_leaves_nothing_behind(preexisting_grad):
    mlp = seeded(FailsOnRecompute, 1, HIDDEN, INTER, dropout=0.3)
    tiled = TiledMLP(mlp, num_shards=3)
    if preexisting_grad:
        for p in mlp.parameters():
            p.grad = torch.full_like(p, 0.5)
    grads_before = [None if p.grad is None else p.grad.clone() for p in mlp.parameters()]
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=3)
    out = tiled(x)
    type(mlp).armed = True  # a class attribute: not one the backward checks, so the recompute itself fails
    rng_before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="boom from inside the wrapped module"):
        out.backward(dy)
    assert torch.equal(rng_before, torch.get_rng_state()), "the shard's replayed RNG state leaked out"
    for p, g in zip(mlp.parameters(), grads_before, strict=True):
        assert (p.grad is None) if g is None else torch.equal(p.grad, g), "a half-written .grad"
    assert x.grad is None
    assert "forward" not in mlp.__dict__

    # The next step, on the same TiledMLP, works and is right.
    type(mlp).armed = False
    for p in mlp.parameters():
        p.grad = None
    x2, dy2 = fresh_inputs((1, 5, HIDDEN), HIDDEN, seed=4)
    torch.manual_seed(8)
    got = tiled(x2)
    got.backward(dy2)
    want = untiled_shardwise_run(mlp, x2, dy2, 3, seed=8)
    torch.testing.assert_close(got.detach(), want.out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x2.grad, want.dx, rtol=1e-10, atol=1e-12)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want.grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_error_in_forward_leaves_no_instance_forward_and_next_call_works():
    mlp = seeded(FailsOnRecompute, 2, HIDDEN, INTER)
    tiled = TiledMLP(mlp, num_shards=3)
    before = snapshot(mlp)
    type(mlp).armed = True  # a class attribute: not one the backward checks, so the recompute itself fails
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN, seed=5)
    with pytest.raises(RuntimeError, match="boom"):
        tiled(x)
    assert_untouched(mlp, before, x)
    type(mlp).armed = False
    out = tiled(x)
    out.backward(dy)
    want = untiled_run(mlp, x, dy)
    torch.testing.assert_close(out.detach(), want.out, rtol=1e-10, atol=1e-12)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want.grads[name], rtol=1e-10, atol=1e-12)


def test_instance_forward_installed_by_another_library_is_kept():
    mlp = seeded(GatedMLP, 3, HIDDEN, INTER)
    original = mlp.forward
    mlp.forward = lambda x: original(x) * 3  # as an accelerate/peft-style patch would
    patched = mlp.forward
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    tiled = TiledMLP(mlp, num_shards=2)
    out = tiled(x)  # the tiled forward runs, each shard through the patched one
    torch.testing.assert_close(out.detach(), patched(x).detach(), rtol=1e-10, atol=1e-12)
    assert tiled.tiling.last_path == "generic"  # never fast: the patch may do more than compute
    untile(tiled)
    assert mlp.__dict__["forward"] is patched and type(mlp) is GatedMLP


def test_untile_refuses_a_module_that_is_not_tiled_or_was_wrapped_again_after_tiling():
    mlp = seeded(GatedMLP, 3, HIDDEN, INTER)
    with pytest.raises(TypeError, match="GatedMLP is not tiled"):
        untile(mlp)
    tiled = TiledMLP(mlp, num_shards=2)
    tiled.__class__ = type("WrappedAgain", (type(tiled),), {})  # as fully_shard swaps the class again
    with pytest.raises(TypeError, match="WrappedAgain was wrapped again after it was tiled"):
        untile(tiled)
    assert type(tiled).__name__ == "WrappedAgain" and tiled.tiling.num_shards == 2  # nothing changed


def test_a_hook_added_between_forward_and_backward_changes_nothing_on_the_fast_path():
    """Untiled, a forward hook added after the forward does not touch its backward; the fast path
    computes its backward from the forward's tensors alone, so the same holds exactly."""
    mlp = seeded(GatedMLP, 4, HIDDEN, 12)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(mlp, x, dy)
    tiled = TiledMLP(mlp, num_shards=2)
    x_in = x.detach().clone().requires_grad_()
    out = tiled(x_in)
    assert tiled.tiling.last_path == "fast"
    fired = []
    mlp.up_proj.register_forward_hook(lambda m, a, o: fired.append(1) or o * 2)
    out.backward(dy)
    assert fired == []
    torch.testing.assert_close(x_in.grad, want.dx, rtol=1e-10, atol=0)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want.grads[name], rtol=1e-10, atol=0)


def test_a_hook_added_between_forward_and_backward_is_named_in_the_error_on_the_generic_path():
    """The generic recompute calls the submodules, so a hook added after the forward would change the
    recomputed values: refused by name before any gradient is written."""
    mlp = PlainMLP(HIDDEN, 12).double()
    tiled = TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = tiled(x)
    assert tiled.tiling.last_path == "generic"
    mlp.fc1.register_forward_hook(lambda m, a, o: o * 2)
    with pytest.raises(RuntimeError, match="changed between its forward and backward.*fc1"):
        out.sum().backward()
    assert x.grad is None and all(p.grad is None for p in mlp.parameters())


def test_a_saved_tiling_state_with_a_bad_shard_count_is_refused_on_load():
    # The call does not check the configured count again: every way it enters the state does, and unpickling
    # (pickle, deepcopy, torch.load) sets a state through __setstate__.
    from tiled_mlp.core.tiling_state import TilingState

    saved = {**TilingState(num_shards=4).__getstate__(), "num_shards": 0}
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        object.__new__(TilingState).__setstate__(saved)
