"""The fast path is taken on proof of what the forward is (its bytecode, or a registration), and its
kernel computes every form it accepts exactly: float64 against the untiled module."""
from __future__ import annotations

import inspect

import pytest
import torch
from reference import GatedMLP, assert_runs_close, fresh_inputs, tiled_run, untiled_run
from torch import nn

import tiled_mlp.core.code_forms as code_forms
from tiled_mlp import TiledMLP, register_gated_mlp, unregister_gated_mlp
from tiled_mlp.core import fast_path_problem, strict
from tiled_mlp.core.gated_forms import KNOWN_BODIES, known_form

pytestmark = pytest.mark.timeout(60)
HIDDEN, INTER, TOKENS = 12, 20, 17


def _llama_body_classes():
    """Every MLP class of the installed transformers whose forward's source is Llama's body."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP

    assert transformers  # the import is what matters
    return [LlamaMLP, MistralMLP, Qwen2MLP, Qwen3MLP, GemmaMLP]


@pytest.mark.parametrize("index", range(5))
def test_installed_library_bodies_are_known(index):
    cls = _llama_body_classes()[index]
    assert known_form(cls.forward) is not None


def test_every_known_body_compiles_and_is_distinct():
    forms = [code_forms._compiled(body, "x", None) for body, _ in KNOWN_BODIES]
    assert len({(c.co_code, c.co_names, c.co_consts) for c in forms}) == len(KNOWN_BODIES)


class Swiglu(GatedMLP):
    def __init__(self):
        super().__init__(HIDDEN, INTER)


def test_a_forward_that_differs_by_one_constant_is_not_known():
    def scaled(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 1.0)

    def other_names(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))  # gate and up swapped

    assert known_form(Swiglu.forward) is not None
    assert known_form(scaled) is None
    assert known_form(other_names) is None


def test_a_forward_with_a_closure_is_not_known():
    factor = 1.0

    def closed(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) if factor else x

    assert known_form(closed) is None


class Odd(nn.Module):
    """A user's gated MLP under other names, with its own factors."""

    def __init__(self, scale: float = 0.75):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTER, bias=True)
        self.w3 = nn.Linear(HIDDEN, INTER, bias=True)
        self.w2 = nn.Linear(INTER, HIDDEN, bias=True)
        self.act = nn.GELU(approximate="tanh")
        self.out_scale = scale

    def forward(self, x):
        return self.w2(self.act(self.w1(x) * 1.5) * (self.w3(x) * 0.5)) * self.out_scale


def _check_path_and_exact(mlp: nn.Module, path: str, num_shards: int = 3):
    mlp = mlp.double()
    x, grad = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, grad, num_shards=num_shards)
    assert tiled.tiling.last_path == path
    assert_runs_close(untiled_run(mlp, x, grad), got)
    return tiled


def test_a_registered_class_takes_the_fast_path_with_its_factors_exactly():
    register_gated_mlp(Odd, gate="w1", up="w3", down="w2", activation="act", gate_scale=1.5, up_scale=0.5,
                       down_scale="out_scale")
    try:
        torch.manual_seed(0)
        _check_path_and_exact(Odd(), "fast")
        _check_path_and_exact(Odd(scale=2.0), "fast")  # a factor read by name at every call
    finally:
        unregister_gated_mlp(Odd)


@pytest.mark.parametrize("value", [torch.tensor(2.0), True, None])
def test_a_named_factor_that_is_not_a_plain_number_takes_the_generic_path(value):
    register_gated_mlp(Odd, gate="w1", up="w3", down="w2", activation="act", gate_scale=1.5, up_scale=0.5,
                       down_scale="out_scale")
    try:
        mlp = Odd()
        assert fast_path_problem(TiledMLP, mlp) == ""
        mlp.__dict__["out_scale"] = value
        assert "(out_scale) is not a plain number" in fast_path_problem(TiledMLP, mlp)
    finally:
        unregister_gated_mlp(Odd)


def test_without_registration_the_same_class_is_generic_and_exact():
    torch.manual_seed(0)
    _check_path_and_exact(Odd(), "generic")


def test_a_forward_patched_after_registration_is_not_covered():
    class Mine(Odd):
        pass

    register_gated_mlp(Mine, gate="w1", up="w3", down="w2", activation="act", gate_scale=1.5, up_scale=0.5,
                       down_scale="out_scale")
    try:
        def patched(self, x):
            return self.w2(self.act(self.w1(x)))

        Mine.forward = patched
        torch.manual_seed(0)
        _check_path_and_exact(Mine(), "generic")
    finally:
        Mine.forward = Odd.forward
        unregister_gated_mlp(Mine)


@pytest.mark.parametrize("kwargs, error", [
    ({"gate_up": "gate_up_proj"}, ValueError),  # both gate/up and gate_up
    ({"gate": None}, ValueError),  # neither complete
    ({"down_scale": [1.0]}, TypeError),
    ({"gate_scale": True}, TypeError),
])
def test_bad_registrations_are_refused(kwargs, error):
    with pytest.raises(error):
        register_gated_mlp(Swiglu, **kwargs)
    with pytest.raises(TypeError):
        register_gated_mlp(object)


def test_falcon_h1_multipliers_take_the_fast_path_exactly():
    transformers = pytest.importorskip("transformers")
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    config = transformers.FalconH1Config(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu",
                                         mlp_bias=False, mlp_multipliers=[0.98, 1.025])
    torch.manual_seed(0)
    _check_path_and_exact(FalconH1MLP(config), "fast")


def test_a_class_attribute_shadowing_a_child_is_not_fast(monkeypatch):
    # A class changed after tiling is seen in strict mode (``tiled_core/strict.py``: the proof's guards).
    monkeypatch.setattr(strict, "ON", True)

    class Shadowed(Swiglu):
        pass

    mlp = Shadowed()
    tiled = TiledMLP(mlp, num_shards=3)
    x = torch.randn(1, TOKENS, HIDDEN)
    tiled(x)
    assert tiled.tiling.last_path == "fast"
    Shadowed.up_proj = property(lambda self: self.gate_proj)  # the forward would now read gate twice
    try:
        reference = Swiglu()
        reference.load_state_dict({k: v for k, v in mlp.state_dict().items()})
        with torch.no_grad():
            want = reference.down_proj(reference.act_fn(reference.gate_proj(x)) * reference.gate_proj(x))
            got = tiled(x)
        assert tiled.tiling.last_path == "generic"
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        del Shadowed.up_proj


def test_a_projection_class_shadowing_its_weight_is_not_fast(monkeypatch):
    # nn.Linear's forward reads ``self.weight``: a class attribute of that name is what it finds, not the
    # registered parameter the fast kernel would compute with.
    torch.manual_seed(0)
    mlp = Swiglu()  # built first: registering a parameter refuses a name the class already has
    monkeypatch.setattr(nn.Linear, "weight", property(lambda self: self._parameters["weight"] * 2), raising=False)
    tiled = _check_path_and_exact(mlp, "generic")
    assert "nn.Linear's class defines weight" in tiled.tiling.last_reason


def test_a_projection_called_through_a_patched_call_is_not_fast(monkeypatch):
    # The fast kernel calls no submodule: a __call__ patched on a child's class would never run.
    torch.manual_seed(0)
    mlp = Swiglu()
    call = nn.Module.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, *args, **kwargs: 2 * call(self, *args, **kwargs),
                        raising=False)
    tiled = _check_path_and_exact(mlp, "generic")
    assert "patched __call__" in tiled.tiling.last_reason


def test_the_signature_of_a_tiled_forward_is_the_original():
    tiled = TiledMLP(Swiglu())
    assert list(inspect.signature(tiled.forward).parameters) == ["x"]
