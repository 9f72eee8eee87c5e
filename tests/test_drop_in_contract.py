"""The drop-in contract: a tiled module computes what the untiled module computes, gradients included.

Every test runs in float64 against the untiled module (a deep copy, or a second build from the same
seed where the module holds something a deep copy would share, such as a closure) and compares the
output, the input gradient and every parameter gradient, plus the gradient of any tensor the forward
reads from outside, unless an error is the expected outcome. Each test says what it guards.
"""
from __future__ import annotations

import copy
import types
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from reference import (
    GatedMLP,
    PlainMLP,
    Run,
    assert_runs_close,
    fresh_inputs,
    param_grads,
    seeded,
    step,
    untiled_run,
    untiled_shardwise_run,
)
from torch import nn
from torch.func import functional_call

from tiled_mlp import TiledMLP
from tiled_mlp.core.shard_plan import make_shard_plan
from tiled_mlp.core.strict import strict_mode

pytestmark = pytest.mark.timeout(120)

HIDDEN, INTER = 8, 12
TOKENS = 7  # prime: no shard count > 1 below 7 divides it
SHAPE = (2, TOKENS, HIDDEN)
TOL = 1e-10


# -- helpers ----------------------------------------------------------------------------------------


def assert_close(want: Optional[torch.Tensor], have: Optional[torch.Tensor], what: str, tol: float = TOL) -> None:
    assert (want is None) == (have is None), f"{what}: gradient presence differs (untiled {want is not None})"
    if want is not None:
        torch.testing.assert_close(have, want, rtol=tol, atol=tol, msg=what)


Build = Callable[[], Tuple[nn.Module, List[torch.Tensor]]]


def compare_with_external(build: Build, num_shards: int = 3, path: str = "auto", expect_path: str = "generic",
                          x_seed: int = 0) -> nn.Module:
    """``build()`` gives a module and the tensors outside it that its forward reads (their grads are
    compared too). It is called twice (same seeds inside): once untiled, once tiled."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=x_seed)
    ref, ref_ext = build()
    mlp, ext = build()
    want = step(ref, x, dy)
    tiled = TiledMLP(mlp, num_shards=num_shards, path=path)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == expect_path
    assert_runs_close(want, got, tol=TOL)
    assert ref_ext, "the build gave no external tensor to check"
    for i, (a, b) in enumerate(zip(ref_ext, ext, strict=True)):
        assert a.grad is not None and bool(a.grad.abs().sum() > 0), "the reference gradient is zero: nothing to compare"
        assert_close(a.grad, b.grad, f"external tensor {i}")
    return tiled


# -- fast path soundness ----------------------------------------------------------------------------
class GainGatedMLP(GatedMLP):
    """A gated MLP with a learnable output gain that is neutral (ones) at init."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.gain = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return super().forward(x) * self.gain


def test_learnable_gain_neutral_at_init_takes_generic_and_gets_its_gradient():
    """Guards: the fast kernel computes from the projections alone, so a module owning one more
    parameter must be refused (on structure; the probe's record of the tensors the forward reads is
    the second line: its numbers cannot see a gain of ones). Taken fast, the gain would get no
    gradient, and after a checkpoint load sets it to 2.0 (in place, same tensor: the cached decision
    is kept) the output would not double."""
    mlp = seeded(GainGatedMLP, 0, HIDDEN, INTER)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=1)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    first = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_run(mlp, x, dy), first, tol=TOL)
    assert first.grads["gain"] is not None

    state = {k: v.clone() for k, v in mlp.state_dict().items()}
    state["gain"] = torch.full((HIDDEN,), 2.0, dtype=torch.float64)
    mlp.load_state_dict(state)
    tiled.load_state_dict(state)
    second = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    torch.testing.assert_close(second.out, 2.0 * first.out, rtol=1e-12, atol=1e-12)
    assert_runs_close(untiled_run(mlp, x, dy), second, tol=TOL)


class SideBranchGatedMLP(GatedMLP):
    """A gated MLP plus a zero-initialised side branch added to its output (a neutral adapter)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.side = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.side.weight)
        nn.init.zeros_(self.side.bias)

    def forward(self, x):
        return super().forward(x) + self.side(x)


def test_zero_initialised_side_branch_takes_generic_and_gets_its_gradient():
    """Guards: a submodule beyond the projections (here contributing zero at init, so the output
    matches the formula) must send the call to the generic path; fast, ``side`` would get no gradient
    although its untiled gradient is non-zero."""
    mlp = seeded(SideBranchGatedMLP, 1, HIDDEN, INTER)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=2)
    want = untiled_run(mlp, x, dy)
    assert float(want.grads["side.weight"].abs().sum()) > 0
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(want, got, tol=TOL)


def assert_generic_and_exact_before_and_after(mlp: nn.Module, change, seed: int) -> None:
    """Generic path and exact at a first call, and again after ``change`` (applied in place to the
    untiled and the tiled copy alike) altered a tensor the forward reads."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=seed)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    for changed in (False, True):
        if changed:
            with torch.no_grad():
                change(mlp)
                change(tiled)
        got = step(tiled, x, dy)
        assert tiled.tiling.last_path == "generic"
        assert_runs_close(untiled_run(mlp, x, dy), got, tol=TOL)


class BufferGatedMLP(GatedMLP):
    """A gated MLP whose output is scaled by a registered buffer (ones at init)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.register_buffer("scale", torch.ones(hidden))

    def forward(self, x):
        return super().forward(x) * self.scale


def test_buffer_read_by_the_forward_takes_generic_and_follows_in_place_updates():
    """Guards: a buffer the forward reads must rule out the fast kernel (which never reads it). At
    init the buffer is neutral, so only structure can tell; after an in-place update (same tensor, so
    a cached decision would be reused) the tiled output must follow it exactly as untiled."""
    mlp = seeded(BufferGatedMLP, 2, HIDDEN, INTER)
    assert_generic_and_exact_before_and_after(mlp, lambda m: m.scale.fill_(3.0), seed=3)


class FunctionalDropoutGatedMLP(GatedMLP):
    """Dropout through ``F.dropout`` (no ``nn.Dropout`` submodule for the structure to see)."""

    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(F.dropout(h, p=0.5, training=self.training))


def test_functional_dropout_in_train_mode_is_never_fast_and_really_drops():
    """Guards: the fast-path decision is remade when the module switches to train mode, and a forward
    that draws random numbers never takes the fast kernel (which would silently skip the dropout).
    The generic path must also replay each shard's random numbers in its recompute: the train-mode
    call equals the untiled module run shard by shard from the same seed, gradients included."""
    num_shards = 3
    mlp = seeded(FunctionalDropoutGatedMLP, 3, HIDDEN, INTER).eval()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=4)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=num_shards)
    eval_run = step(tiled, x, dy)
    # Either path is sound in eval mode (here generic: F.dropout is recorded as a random call even with
    # training=False); what matters is that the train-mode call below does not reuse a fast decision.
    assert tiled.tiling.last_path in ("fast", "generic")
    assert_runs_close(untiled_run(mlp, x, dy), eval_run, tol=TOL)

    mlp.train()
    tiled.train()
    train_run = step(tiled, x, dy, seed=42)
    assert tiled.tiling.last_path == "generic"
    assert not torch.allclose(train_run.out, eval_run.out), "train mode did not drop anything"
    want = untiled_shardwise_run(mlp, x, dy, num_shards, seed=42)
    assert not torch.allclose(want.out, untiled_shardwise_run(mlp, x, dy, num_shards, seed=43).out)
    assert_runs_close(want, train_run, tol=TOL)


class CastingGatedMLP(GatedMLP):
    """Casts its input to the weights' dtype, as many HF MLPs do under mixed precision."""

    def forward(self, x):
        x = x.to(self.gate_proj.weight.dtype)
        return super().forward(x)


def test_forward_that_casts_its_input_runs_generic_and_matches_untiled():
    """Guards: a float64 input on float32 weights must not reach the fast kernel (it would fail on
    mixed dtypes, or compute in the wrong one); the generic path runs the module's own cast, the
    output is float32 and the input gradient float64, as untiled."""
    mlp = seeded(CastingGatedMLP, 4, HIDDEN, INTER, dtype=torch.float32)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=5)  # float64 input
    dy = dy.float()
    ref = copy.deepcopy(mlp)
    want = step(ref, x, dy)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    assert got.out.dtype == want.out.dtype == torch.float32
    assert got.dx.dtype == want.dx.dtype == torch.float64
    # float32 rounding, summed over at most 14 tokens in another order.
    assert_runs_close(want, got, tol=1e-5)


class AttributeScaleGatedMLP(GatedMLP):
    """A plain (unregistered) tensor attribute multiplied into the output."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.scale = torch.ones(hidden, dtype=torch.float64)

    def forward(self, x):
        return super().forward(x) * self.scale


def test_plain_tensor_attribute_takes_generic_and_follows_in_place_updates():
    """Guards: a tensor attribute (neither parameter nor buffer, so not in the decision's cache key)
    must rule out the fast kernel on structure: neutral at the first call, then changed in place, the
    tiled output must follow it as untiled."""
    mlp = seeded(AttributeScaleGatedMLP, 5, HIDDEN, INTER)
    assert_generic_and_exact_before_and_after(mlp, lambda m: m.scale.mul_(3.0), seed=6)


# -- tensors from outside the module's parameters ---------------------------------------------------
class ExtraAttrGatedMLP(GatedMLP):
    """A weight held in a plain attribute that requires grad (not an ``nn.Parameter``)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.extra = torch.randn(hidden, dtype=torch.float64, requires_grad=True)

    def forward(self, x):
        return super().forward(x) * self.extra


def _extra_attr() -> Tuple[nn.Module, List[torch.Tensor]]:
    mlp = seeded(ExtraAttrGatedMLP, 6, HIDDEN, INTER)
    return mlp, [mlp.extra]


@pytest.mark.parametrize("path", ["auto", "generic"])
def test_weight_in_a_plain_attribute_gets_the_untiled_gradient(path):
    """Guards: a tensor that requires grad and is read by the forward without being a parameter is
    found and made an input of the sharded Function; otherwise its ``.grad`` would stay None."""
    compare_with_external(_extra_attr, path=path)


class PostGatedMLP(GatedMLP):
    """Calls ``self.post`` (set from outside: a closure) on its output."""

    def forward(self, x):
        return self.post(super().forward(x))


class RouterGatedMLP(GatedMLP):
    """Reads a weight from a ``SimpleNamespace`` attribute, as Axolotl's packed-MoE router does."""

    def forward(self, x):
        return super().forward(x) * self.router.weight


def _external_weight(neutral: bool) -> torch.Tensor:
    w = torch.ones(HIDDEN, dtype=torch.float64) if neutral else 1.0 + 0.5 * torch.randn(HIDDEN, dtype=torch.float64)
    return w.requires_grad_()


def _closure(neutral: bool) -> Build:
    def build():
        mlp = seeded(PostGatedMLP, 7, HIDDEN, INTER)
        w = _external_weight(neutral)
        mlp.post = lambda y: y * w
        return mlp, [w]
    return build


def _namespace(neutral: bool) -> Build:
    def build():
        mlp = seeded(RouterGatedMLP, 7, HIDDEN, INTER)
        mlp.router = types.SimpleNamespace(weight=_external_weight(neutral))
        return mlp, [mlp.router.weight]
    return build


@pytest.mark.parametrize("neutral", [True, False], ids=["neutral", "random"])
@pytest.mark.parametrize("holder", [_closure, _namespace], ids=["closure", "namespace"])
def test_weight_in_a_closure_or_namespace_gets_the_untiled_gradient(holder, neutral):
    """Guards: a weight the structure cannot see (a closure, a namespace object) must still keep the
    fast kernel away, through the probe's record of what the forward reads even where the numbers
    agree (a neutral weight of ones), and must get its untiled gradient on the generic path."""
    compare_with_external(holder(neutral))


def _hooked_child() -> Tuple[nn.Module, List[torch.Tensor]]:
    mlp = seeded(GatedMLP, 8, HIDDEN, INTER, "gelu", bias=True)
    t = torch.randn(HIDDEN, dtype=torch.float64, requires_grad=True)
    mlp.down_proj.register_forward_hook(lambda m, args, out: out + t)
    return mlp, [t]


def test_tensor_added_by_a_child_forward_hook_gets_the_untiled_gradient():
    """Guards: a tensor that a hook on a submodule adds is read inside each shard; it must become an
    input of the sharded Function so that it gets exactly the untiled gradient, once per backward."""
    compare_with_external(_hooked_child)


class FiLMGatedMLP(GatedMLP):
    """Multiplies its output by ``self.cond``, conditioning set from outside before each call."""

    def forward(self, x):
        return super().forward(x) * self.cond


def test_film_conditioning_from_outside_sends_its_gradient_upstream():
    """Guards: a NON-leaf tensor read by the forward (FiLM conditioning computed from another module's
    parameter) must pass its gradient on through its own graph: the upstream embedding gets exactly
    the untiled gradient, over two steps with different conditioning (accumulated)."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=9)

    def build():
        mlp = seeded(FiLMGatedMLP, 9, HIDDEN, INTER)
        torch.manual_seed(10)
        embed = nn.Embedding(4, HIDDEN).double()
        return mlp, embed

    ref, ref_embed = build()
    mlp, embed = build()
    tiled = TiledMLP(mlp, num_shards=3)
    for code in (1, 3):
        c = torch.tensor([[code]])
        outs = []
        for module, emb in ((ref, ref_embed), (tiled, embed)):
            module.cond = emb(c)
            assert module.cond.grad_fn is not None
            x_in = x.detach().clone().requires_grad_()
            out = module(x_in)
            out.backward(dy)
            outs.append((out.detach(), x_in.grad))
        assert tiled.tiling.last_path == "generic"
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=TOL, atol=TOL)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=TOL, atol=TOL)
    assert float(ref_embed.weight.grad.abs().sum()) > 0
    assert_close(ref_embed.weight.grad, embed.weight.grad, "embed.weight")
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters(), strict=True):
        assert_close(q.grad, p.grad, name)


def test_hook_that_stashes_an_activation_for_a_loss_is_an_error_under_grad():
    with strict_mode():  # kept tensors are looked for in strict mode (``tiled_core/strict.py``)
        _stashed_activation_is_an_error()


def _stashed_activation_is_an_error():
    """Guards: a hook on a submodule that keeps a tensor (an activation penalty for the loss) would,
    tiled, keep a no-grad tensor of one shard: the loss term would silently carry no gradient. Under
    grad that is a clear RuntimeError before any gradient is written; under ``no_grad`` (evaluation)
    it runs, the hook firing once per shard with that shard's activations."""
    num_shards = 3
    mlp = seeded(GatedMLP, 11, HIDDEN, INTER)
    ref = copy.deepcopy(mlp)
    acts: List[torch.Tensor] = []
    mlp.down_proj.register_forward_hook(lambda m, args, out: acts.append(out.pow(2).mean()))
    tiled = TiledMLP(mlp, num_shards=num_shards)
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=11)
    with pytest.raises(RuntimeError, match="were kept after their shard"):
        tiled(x)
    assert x.grad is None and all(p.grad is None for p in mlp.parameters())

    acts.clear()
    with torch.no_grad():
        out = tiled(x)
        want = ref(x)
    assert tiled.tiling.last_path == "generic"
    torch.testing.assert_close(out, want, rtol=TOL, atol=TOL)
    assert len(acts) == num_shards
    flat = want.reshape(-1, HIDDEN)
    for got, shard in zip(acts, make_shard_plan(flat.shape[0], num_shards).slices(), strict=True):
        torch.testing.assert_close(got, flat[shard].pow(2).mean(), rtol=TOL, atol=TOL)


# -- other parts of the contract --------------------------------------------------------------------
@pytest.mark.parametrize("path, expect", [("auto", "fast"), ("generic", "generic")])
def test_in_place_add_on_the_output(path, expect):
    """Guards: ``y = tiled(x); y += residual`` (a residual added in place) must be allowed and give the
    untiled gradients: the Function must not save its output or hand out a view of a buffer."""
    mlp = seeded(GatedMLP, 12, HIDDEN, INTER, bias=True)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=12)
    residual0 = torch.randn(SHAPE, dtype=torch.float64)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)
    results = []
    for module in (copy.deepcopy(mlp), tiled):
        x_in = x.detach().clone().requires_grad_()
        residual = residual0.clone().requires_grad_()
        y = module(x_in)
        y += residual
        y.backward(dy)
        results.append((Run(y.detach(), x_in.grad, param_grads(module)), residual.grad))
    (want, want_res), (got, got_res) = results
    assert tiled.tiling.last_path == expect
    assert_runs_close(want, got, tol=TOL)
    assert_close(want_res, got_res, "residual")


class BatchNormMLP(nn.Module):
    """fc1 -> BatchNorm1d over the features -> gelu -> fc2: a forward with running statistics."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.norm = nn.BatchNorm1d(intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x):
        h = self.fc1(x)
        h = self.norm(h.reshape(-1, h.shape[-1])).view_as(h)
        return self.fc2(F.gelu(h))


class FunctionalRunningNormMLP(nn.Module):
    """fc1 -> ``F.batch_norm`` on its own running-statistics buffers (no step counter) -> gelu -> fc2."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.register_buffer("stat_mean", torch.zeros(intermediate))
        self.register_buffer("stat_var", torch.ones(intermediate))

    def forward(self, x):
        h = self.fc1(x)
        h = F.batch_norm(h.reshape(-1, h.shape[-1]), self.stat_mean, self.stat_var, training=self.training,
                         momentum=0.1).view_as(h)
        return self.fc2(F.gelu(h))


def _running_norm_mlp(kind: str) -> nn.Module:
    mlp = seeded(BatchNormMLP if kind == "module" else FunctionalRunningNormMLP, 13, HIDDEN, INTER)
    with torch.no_grad():  # non-trivial statistics, so eval mode really uses them
        for name, b in mlp.named_buffers():
            if "mean" in name:
                b.normal_()
            elif "var" in name:
                b.uniform_(0.5, 2.0)
        if kind == "module":
            mlp.norm.weight.normal_()
            mlp.norm.bias.normal_()
    return mlp


def _buffers(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def _assert_buffers_equal(module: nn.Module, before: Dict[str, torch.Tensor]) -> None:
    now = dict(module.named_buffers())
    assert now.keys() == before.keys()
    changed = [name for name, value in before.items() if not torch.equal(now[name], value)]
    assert not changed, f"buffers changed: {changed}"


def _train_mode_call_is_refused(tiled: nn.Module, x: torch.Tensor, grad: bool, match: str) -> None:
    """A train-mode call of a module whose forward updates buffers: refused with ``match``, nothing
    left behind (buffers exactly as before, no gradient anywhere)."""
    before = _buffers(tiled)
    x_in = x.detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=match):
        tiled(x_in)
    _assert_buffers_equal(tiled, before)
    assert x_in.grad is None and all(p.grad is None for p in tiled.parameters())


NORM_BUFFERS = {"module": r"norm\.(running_mean|running_var|num_batches_tracked)", "functional": r"stat_(mean|var)"}


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", NORM_BUFFERS)
def test_batch_norm_in_train_mode_is_refused_and_its_statistics_are_put_back(kind, grad):
    """Guards: a forward that updates buffers in place (BatchNorm's running statistics, through
    ``nn.BatchNorm1d`` or ``F.batch_norm`` on the module's own buffers) would update them once per
    shard and again in each recompute. In train mode, in a training step (grad) as in evaluation
    (no_grad), that must be a RuntimeError naming the buffers, with every statistic exactly as before
    the call (as the error message says), and no gradient written."""
    tiled = TiledMLP(_running_norm_mlp(kind), num_shards=2).train()
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=13)
    _train_mode_call_is_refused(tiled, x, grad, match=r"updated its buffers \(.*" + NORM_BUFFERS[kind])


@pytest.mark.parametrize("kind", ["module", "functional"])
def test_batch_norm_in_eval_mode_matches_untiled(kind):
    """Guards: in eval mode BatchNorm is token-wise and keeps its buffers: the tiled call runs it
    (generic) and matches untiled exactly, statistics untouched."""
    _assert_eval_mode_exact_and_buffers_kept(_running_norm_mlp(kind).eval(), seed=13)


def _assert_eval_mode_exact_and_buffers_kept(mlp: nn.Module, seed: int) -> None:
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=seed)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=2)
    before = _buffers(tiled)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    _assert_buffers_equal(tiled, before)
    assert_runs_close(untiled_run(mlp, x, dy), got, tol=TOL)


def _spectral_norm_mlp() -> nn.Module:
    torch.manual_seed(14)
    mlp = PlainMLP(HIDDEN, INTER).double()
    torch.nn.utils.parametrizations.spectral_norm(mlp.fc1)
    return mlp


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_spectral_norm_in_train_mode_is_refused_and_its_buffers_are_put_back(grad):
    """Guards: spectral_norm's power iteration updates its ``_u``/``_v`` buffers in place in train mode;
    tiled, that would run once per shard and again in the recompute. Refused by name, buffers restored."""
    tiled = TiledMLP(_spectral_norm_mlp(), num_shards=2).train()
    assert any(name.endswith("_u") for name in _buffers(tiled))
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=14)
    _train_mode_call_is_refused(tiled, x, grad, match=r"updated its buffers \(.*_u")


def test_spectral_norm_in_eval_mode_matches_untiled():
    """Guards: in eval mode spectral_norm reuses its buffers without updating them: tiled matches untiled."""
    _assert_eval_mode_exact_and_buffers_kept(_spectral_norm_mlp().eval(), seed=14)


class UnusedParamMLP(PlainMLP):
    """A parameter the forward never reads, a frozen one it reads, and a frozen one it never reads."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__(hidden, intermediate)
        self.unused = nn.Parameter(torch.randn(hidden))
        self.frozen = nn.Parameter(torch.randn(hidden), requires_grad=False)
        self.frozen_unused = nn.Parameter(torch.randn(hidden), requires_grad=False)

    def forward(self, x):
        return super().forward(x) * self.frozen


@pytest.mark.parametrize("path", ["generic", "auto"])
def test_unused_parameter_keeps_a_none_gradient_on_a_single_device(path):
    """Guards: untiled, a parameter the forward never uses keeps ``.grad is None`` (optimizers skip it,
    weight decay does not touch it); tiled on a single device it must too, not get zeros; frozen
    parameters get no gradient."""
    mlp = seeded(UnusedParamMLP, 15, HIDDEN, INTER)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=15)
    want = untiled_run(mlp, x, dy)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == "generic"
    assert got.grads["unused"] is None and got.grads["frozen"] is None and got.grads["frozen_unused"] is None
    assert_runs_close(want, got, tol=TOL)


@pytest.mark.parametrize("builder, expect", [(GatedMLP, "fast"), (PlainMLP, "generic")])
def test_functional_call_with_non_leaf_params_gives_their_untiled_gradients(builder, expect):
    """Guards: ``torch.func.functional_call`` swaps the parameters only while the call runs; the
    backward (after it) must use the call's tensors, not the module's own, and send the gradients to
    them (non-leaf: through their ``* 1.0`` to the leaves), also on the fast kernel after an ordinary
    call cached its decision for the module's own parameters. The module's own ``.grad`` stays None."""
    mlp = seeded(builder, 16, HIDDEN, INTER)
    for p in mlp.parameters():  # the functional parameters differ from the module's own
        p.data.mul_(0.5)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=16)
    ref = copy.deepcopy(mlp)
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    with torch.no_grad():
        tiled(x)  # an ordinary call first: it caches a decision for the module's own parameters
    base = {n: 2.0 * p.detach() for n, p in mlp.named_parameters()}

    results = []
    for module in (ref, tiled):
        leaves = {n: b.clone().requires_grad_() for n, b in base.items()}
        params = {n: t * 1.0 for n, t in leaves.items()}
        x_in = x.detach().clone().requires_grad_()
        out = functional_call(module, params, (x_in,))
        out.backward(dy)
        results.append(Run(out.detach(), x_in.grad, {n: t.grad for n, t in leaves.items()}))
        assert all(p.grad is None for p in module.parameters()), "the module's own parameters got a gradient"
    assert tiled.tiling.last_path == expect
    assert_runs_close(results[0], results[1], tol=TOL)
    with torch.no_grad():  # and the module's own parameters are back in place afterwards
        torch.testing.assert_close(tiled(x), ref(x), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("builder, expect", [(GatedMLP, "fast"), (PlainMLP, "generic")])
def test_gradcheck_through_functional_call(builder, expect):
    """Guards: the tiled backward is the true derivative of the tiled forward with respect to the input
    and every weight, on both kernels, checked against finite differences (not against our own
    reference) through ``functional_call``."""
    hidden, inter, tokens = 4, 6, 5
    mlp = seeded(builder, 18, hidden, inter)
    tiled = TiledMLP(mlp, num_shards=2)
    names = [n for n, _ in mlp.named_parameters()]
    weights = [p.detach().clone().requires_grad_() for p in mlp.parameters()]
    x = torch.randn(1, tokens, hidden, dtype=torch.float64, requires_grad=True)

    def f(inp, *ws):
        return functional_call(tiled, dict(zip(names, ws, strict=True)), (inp,))

    assert torch.autograd.gradcheck(f, (x, *weights), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert tiled.tiling.last_path == expect and tiled.tiling.last_num_shards == 2


@pytest.mark.parametrize("builder, path, expect", [(GatedMLP, "auto", "fast"), (GatedMLP, "generic", "generic"),
                                                   (PlainMLP, "auto", "generic")])
def test_meta_device_forward_and_backward(builder, path, expect):
    """Guards: meta tensors (memory modelling, ``tiled-mlp plan``) have no values to probe or to replay
    random numbers from: the tiled call must still give a meta output of the right shape, and a
    backward with meta gradients of the right shapes, without error."""
    mlp = builder(HIDDEN, INTER).to("meta")
    tiled = TiledMLP(mlp, num_shards=2, path=path)
    x = torch.randn(1, TOKENS, HIDDEN, device="meta", requires_grad=True)
    out = tiled(x)
    assert out.is_meta and out.shape == (1, TOKENS, HIDDEN)
    assert tiled.tiling.last_path == expect and tiled.tiling.last_num_shards == 2
    out.backward(torch.randn(1, TOKENS, HIDDEN, device="meta"))
    assert x.grad is not None and x.grad.is_meta and x.grad.shape == x.shape
    for name, p in tiled.named_parameters():
        assert p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape, name


def test_a_slice_of_a_tiled_sequential_is_a_tiled_sequential_of_the_slice():
    """``nn.Sequential`` builds a slice as ``type(self)(...)``: a slice of a tiled Sequential is a Sequential of
    the same child modules, tiled with the defaults, computing what the untiled slice computes."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double()
    tiled = TiledMLP(copy.deepcopy(seq), num_shards=2)
    part = tiled[0:2]
    assert isinstance(part, TiledMLP) and isinstance(part, nn.Sequential) and part.tiling.num_shards == "auto"
    assert list(part) == [tiled[0], tiled[1]]
    x = torch.randn(1, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(part(x), seq[1](seq[0](x)), rtol=0, atol=0)
