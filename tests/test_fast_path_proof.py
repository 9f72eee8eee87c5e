"""The fast path must be proven, never guessed from a numeric probe.

Every class below has the gated structure (``gate_proj``/``up_proj``/``down_proj`` plain ``nn.Linear``,
``act_fn = nn.SiLU()``), so structure alone cannot tell it from a SwiGLU MLP, but its forward computes
something else: in a way a probe run under ``no_grad`` on a few tokens cannot see (an in-place edit of
the input, a clamp active only for large values, a branch on grad mode, a factor within bf16's
tolerance), or only after a first call (its class, a class attribute, a submodule's class or a flag
in a mutable attribute changes). The tiled module must compute what the untiled one does, in float64:
output, input gradient and every parameter gradient (None where the untiled one gives None).

The HF families' MLPs must still take the fast path, and without running a probe: they are known by
their forward.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
from reference import assert_runs_close, fresh_inputs, step
from torch import nn

import tiled_mlp.core.fast_path
import tiled_mlp.core.gated_spec
from tiled_mlp import TiledMLP

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 16, 32, 30
SHAPE = (2, TOKENS, HIDDEN)
TOL = 1e-10


# -- helpers ----------------------------------------------------------------------------------------
class GatedLooking(nn.Module):
    """The gated structure; each subclass says what its forward really computes."""

    def __init__(self, hidden: int = HIDDEN, intermediate: int = INTER):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()


class ExactSwiGLU(GatedLooking):
    """Exactly SwiGLU: the fast path may stand in for it."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def seeded_mlp(cls, seed: int = 0, dtype=torch.float64, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return cls(**kwargs).to(dtype)


def tiled_copy(mlp: nn.Module, num_shards: int = 4, path: str = "auto") -> nn.Module:
    return TiledMLP(copy.deepcopy(mlp), num_shards=num_shards, path=path)


def assert_tiled_equals_untiled(mlp: nn.Module, x: torch.Tensor, dy: torch.Tensor, num_shards: int = 4,
                                path: str = "auto") -> nn.Module:
    want = step(copy.deepcopy(mlp), x, dy)
    tiled = tiled_copy(mlp, num_shards, path)
    got = step(tiled, x, dy)
    assert_runs_close(want, got, tol=TOL, context=type(mlp).__name__)
    assert tiled.tiling.last_num_shards == num_shards
    return tiled


# -- a forward that edits its input in place --------------------------------------------------------
class InPlaceInputMLP(GatedLooking):
    def forward(self, x):
        x.mul_(2)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("path", ["auto", "generic"])
def test_a_forward_that_edits_its_input_in_place_is_refused_loudly(path):
    """A probe under no_grad would see ``formula(2p)`` both from the forward and from the reference it
    computes after (on the probe the forward has doubled), so it would accept the fast path, which would
    return ``formula(x)`` where the untiled module returns ``formula(2x)``. The generic path's shards are
    views of the saved input, which the forward doubles, so its recompute would double it again. The
    tiled call cannot recompute from an input its forward overwrote: it must refuse, before any
    number comes out."""
    mlp = seeded_mlp(InPlaceInputMLP)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=1)
    leaf = x.detach().clone().requires_grad_()
    copy.deepcopy(mlp)(leaf * 1).backward(dy)  # untiled: fine on a non-leaf input
    assert leaf.grad is not None

    tiled = tiled_copy(mlp, path=path)
    with pytest.raises(RuntimeError, match="modified its input in place"):
        tiled(x.detach().clone().requires_grad_() * 1)


# -- a clamp that only large values reach ------------------------------------------------------------
class ClampedSwiGLU(GatedLooking):
    """GPT-OSS's clamped SwiGLU."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=7.0) * self.up_proj(x).clamp(-7, 7))


def test_gpt_oss_style_clamp_takes_the_generic_path_and_is_exact():
    mlp = seeded_mlp(ClampedSwiGLU)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=2)
    x = x * 50
    with torch.no_grad():  # the clamp must be active on these inputs, or the test compares nothing
        h = mlp.gate_proj(x)
        assert bool((mlp.act_fn(h) > 7).any()) and bool((mlp.up_proj(x).abs() > 7).any())
    tiled = assert_tiled_equals_untiled(mlp, x, dy)
    assert tiled.tiling.last_path == "generic"


# -- a branch on grad mode -----------------------------------------------------------------------------
class GradModeBranchMLP(GatedLooking):
    def forward(self, x):
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if torch.is_grad_enabled():
            h = h * 1.5
        return self.down_proj(h)


@pytest.mark.parametrize("path", ["auto", "generic"])
def test_a_branch_on_grad_mode_computes_what_the_untiled_module_does_in_training(path):
    """A probe under no_grad sees the plain formula; the training call multiplies by 1.5. The generic
    path too: its forward shards must run in the caller's grad mode (the recompute runs with grad)."""
    mlp = seeded_mlp(GradModeBranchMLP)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=3)
    assert_tiled_equals_untiled(mlp, x, dy, path=path)


def test_a_branch_on_grad_mode_computes_what_the_untiled_module_does_under_no_grad():
    mlp = seeded_mlp(GradModeBranchMLP)
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=4, requires_grad=False)
    tiled = tiled_copy(mlp)
    with torch.no_grad():
        want = mlp(x)
        got = tiled(x)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    assert tiled.tiling.last_num_shards == 4


# -- a factor within bf16's probe tolerance ------------------------------------------------------------
class FalconH1StyleMLP(GatedLooking):
    """FalconH1 scales gate and up by multipliers close to 1."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x) * 0.98) * (self.up_proj(x) * 1.025))


def test_bf16_multipliers_close_to_one_are_not_dropped():
    """In bf16 a numeric probe needs a tolerance of a few percent, so it would accept a forward whose
    multipliers change the output by less than that, and the fast kernel would drop them."""
    mlp = seeded_mlp(FalconH1StyleMLP, dtype=torch.bfloat16)
    x, _ = fresh_inputs((1, 24, HIDDEN), HIDDEN, dtype=torch.bfloat16, seed=5)
    x = (x * 4).detach().requires_grad_()
    want = copy.deepcopy(mlp)(x.detach().clone().requires_grad_())
    tiled = tiled_copy(mlp)
    got = tiled(x).detach().float()
    want = want.detach().float()
    # Dropping both multipliers moves this output by 0.7% of its largest value (they partly cancel).
    err = (got - want).abs().max()
    assert err < 0.005 * want.abs().max(), f"max |diff| {float(err):.3g} vs max |out| {float(want.abs().max()):.3g}"
    assert tiled.tiling.last_path == "generic"


# -- what changes after the first fast call -----------------------------------------------------------
def check_change_after_first_call(mlp: nn.Module, change, change_is_per_instance: bool) -> None:
    """Tile a copy of ``mlp``, call it once, apply ``change`` (to the tiled module and to an untiled
    copy, or once where it is made on a class they share), and compare the second call."""
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=6)
    tiled = tiled_copy(mlp)
    step(tiled, x, dy)
    first_path = tiled.tiling.last_path
    assert first_path in ("fast", "generic")

    x2, dy2 = fresh_inputs(SHAPE, HIDDEN, seed=7)
    unchanged = step(copy.deepcopy(mlp), x2, dy2)
    ref = copy.deepcopy(mlp)
    change(tiled)
    if change_is_per_instance:
        change(ref)
    want = step(ref, x2, dy2)
    assert not torch.allclose(want.out, unchanged.out), "the change had no effect: the test would compare nothing"
    got = step(tiled, x2, dy2)
    assert_runs_close(want, got, tol=TOL, context=f"first call took {first_path!r}")
    assert tiled.tiling.last_path in ("fast", "generic") and tiled.tiling.last_num_shards == 4


def test_the_class_forward_patched_after_the_first_call():
    class Patched(ExactSwiGLU):
        pass

    def gate_only(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)))

    def change(module):
        Patched.forward = gate_only

    check_change_after_first_call(seeded_mlp(Patched), change, change_is_per_instance=False)


def test_a_class_attribute_the_forward_reads_flipped_after_the_first_call():
    class Switchable(GatedLooking):
        use_up = True

        def forward(self, x):
            g = self.act_fn(self.gate_proj(x))
            return self.down_proj(g * self.up_proj(x) if self.use_up else g)

    def change(module):
        Switchable.use_up = False

    check_change_after_first_call(seeded_mlp(Switchable), change, change_is_per_instance=False)


def test_the_activation_class_swapped_after_the_first_call():
    def change(module):
        module.act_fn.__class__ = nn.Tanh

    check_change_after_first_call(seeded_mlp(ExactSwiGLU), change, change_is_per_instance=True)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_projection_class_swapped_after_the_first_call():
    def change(module):
        module.down_proj.__class__ = ScaledLinear

    check_change_after_first_call(seeded_mlp(ExactSwiGLU), change, change_is_per_instance=True)


def test_a_flag_flipped_inside_a_mutable_attribute_after_the_first_call():
    class Configured(GatedLooking):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(use_up=True)

        def forward(self, x):
            g = self.act_fn(self.gate_proj(x))
            return self.down_proj(g * self.up_proj(x) if self.config.use_up else g)

    def change(module):
        module.config.use_up = False

    check_change_after_first_call(seeded_mlp(Configured), change, change_is_per_instance=True)


# -- the fast path is still taken where it should be --------------------------------------------------
HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")


def hf_mlp(family: str) -> nn.Module:
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import tiny_model

    return copy.deepcopy(tiny_model(family).model.layers[0].mlp)


def _check_hf_family_fast_and_exact(family: str) -> None:
    mlp = hf_mlp(family)
    x, dy = fresh_inputs((2, 13, mlp.down_proj.out_features), mlp.down_proj.out_features, seed=8)
    tiled = assert_tiled_equals_untiled(mlp, x, dy, num_shards=3)
    assert tiled.tiling.last_path == "fast", type(mlp).__name__


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_family_mlp_takes_the_fast_path_exactly(family):
    _check_hf_family_fast_and_exact(family)


def _probe_used(*args, **kwargs):
    raise AssertionError("probe used as proof")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_family_mlp_takes_the_fast_path_without_a_numeric_probe(family, monkeypatch):
    """Known HF classes are recognised by their forward function, not by running it on numbers."""
    monkeypatch.setattr(tiled_mlp.core.gated_spec, "probe_forward", _probe_used, raising=False)
    monkeypatch.setattr(tiled_mlp.core.fast_path, "probe_forward", _probe_used, raising=False)
    _check_hf_family_fast_and_exact(family)
