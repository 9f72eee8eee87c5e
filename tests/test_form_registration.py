"""What the fast path recognises is registered: the core alone knows torch's own modules, functions
and kernels; ``tiled_mlp`` registers the library forms it knows when imported; anyone else registers
theirs the same way, and the kernel then computes their form exactly (float64 against the untiled
module)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import assert_runs_close, fresh_inputs, tiled_run, untiled_run
from torch import nn

from tiled_mlp.core.code_forms import CodeForm
from tiled_mlp.core.gated_forms import (
    F_SILU,
    GatedForm,
    known_form,
    linear_is_a_linear,
    recognised_activation,
    register_activation,
    register_equivalent_linear,
    register_gated_form,
    unregister_activation,
    unregister_equivalent_linear,
    unregister_gated_form,
)
from tiled_mlp.core.kernels.gated import NativeGatedActivation, register_fused_kernel, unregister_fused_kernel

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTER, TOKENS = 8, 12, 13

CORE_ALONE = textwrap.dedent('''
    import sys, types
    import torch
    import torch.nn.functional as F
    from torch import nn

    # The core on its own: its installed name, without the facade's __init__ (which imports the
    # integrations, and with them every registration).
    facade = types.ModuleType("tiled_mlp")
    facade.__path__ = ["tiled_mlp"]
    sys.modules["tiled_mlp"] = facade
    import tiled_mlp.core
    from tiled_mlp.core import gated_forms
    from tiled_mlp.core.gated_forms import known_form, linear_is_a_linear, recognised_activation

    class Mlp(nn.Module):  # the body transformers writes for LlamaMLP
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
            self.down_proj, self.act_fn = nn.Linear(12, 8, bias=False), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class SiLUActivation(nn.Module):  # transformers.activations' body
        def forward(self, input):
            return nn.functional.silu(input)

    def zero3_linear_wrap(input, weight, bias=None):
        return torch.nn.functional.linear(input, weight, bias)

    zero3_linear_wrap.__module__ = "deepspeed.runtime.zero.linear"
    sys.modules["deepspeed.runtime.zero.linear"] = types.SimpleNamespace(zero3_linear_wrap=zero3_linear_wrap)

    def known():
        return (known_form(Mlp.forward) is not None, recognised_activation(SiLUActivation())[0],
                linear_is_a_linear(zero3_linear_wrap), len(gated_forms.KNOWN_BODIES))

    alone = known()
    assert "tiled_mlp.integrations" not in sys.modules and "transformers" not in sys.modules, sorted(sys.modules)
    torch.manual_seed(0)
    mlp = Mlp().double()
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    want.sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    tiled = tiled_mlp.core.TiledMLP(mlp, num_shards=3)
    got = tiled(x)
    got.sum().backward()
    got_grads = [x.grad] + [p.grad for p in mlp.parameters()]
    error = max((a - b).abs().max().item() for a, b in zip([want] + want_grads, [got] + got_grads))
    path = tiled.tiling.last_path

    del sys.modules["tiled_mlp"]
    import tiled_mlp  # noqa: F401  # the facade, on the same core modules
    print(alone, path, error < 1e-12, known())
''')


def test_the_core_alone_knows_no_library_form_and_tiled_mlp_registers_them():
    result = subprocess.run([sys.executable, "-c", CORE_ALONE], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(False, None, False, 0) generic True (True, 'silu', True, 6)", result.stdout


class ThirdParty(nn.Module):
    """A gated MLP under its own names, with an activation class of its own."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(HIDDEN, INTER, bias=True)
        self.b = nn.Linear(HIDDEN, INTER, bias=True)
        self.out = nn.Linear(INTER, HIDDEN, bias=True)
        self.nonlin = ThirdPartySiLU()

    def forward(self, x):
        return self.out(self.nonlin(self.a(x)) * self.b(x))


class ThirdPartySiLU(nn.Module):
    def forward(self, x):
        return F.silu(x)


THIRD_PARTY_BODY = CodeForm("return self.out(self.nonlin(self.a({x})) * self.b({x}))")
THIRD_PARTY_FORM = GatedForm(down="out", gate="a", up="b", activation="nonlin")
THIRD_PARTY_ACTIVATION = CodeForm("return F.silu({x})", {"F": F, "F.silu": F_SILU})


def _path_and_check(mlp: nn.Module) -> str:
    x, grad = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, grad, num_shards=3)
    assert_runs_close(untiled_run(mlp, x, grad), got)
    return tiled.tiling.last_path


def test_a_third_party_registers_its_form_and_activation_and_takes_the_fast_path_exactly():
    torch.manual_seed(0)
    mlp = ThirdParty().double()
    assert _path_and_check(mlp) == "generic"
    register_gated_form(THIRD_PARTY_BODY, THIRD_PARTY_FORM)
    try:
        assert known_form(ThirdParty.forward) == THIRD_PARTY_FORM
        assert _path_and_check(mlp) == "generic"  # its activation is not recognised yet
        register_activation(THIRD_PARTY_ACTIVATION, computes="silu")
        try:
            assert recognised_activation(ThirdPartySiLU()) == ("silu", ())
            assert _path_and_check(mlp) == "fast"
        finally:
            unregister_activation(THIRD_PARTY_ACTIVATION)
        assert recognised_activation(ThirdPartySiLU()) == (None, ())
    finally:
        unregister_gated_form(THIRD_PARTY_BODY)
    assert known_form(ThirdParty.forward) is None
    assert _path_and_check(mlp) == "generic"  # withdrawing a form changes the cached decision's key


def test_registering_or_withdrawing_a_form_changes_a_tiled_modules_next_decision():
    from tiled_mlp import TiledMLP

    tiled = TiledMLP(ThirdParty().double(), num_shards=3)
    x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64)
    paths = []
    tiled(x)
    paths.append(tiled.tiling.last_path)
    register_activation(THIRD_PARTY_ACTIVATION, computes="silu")
    register_gated_form(THIRD_PARTY_BODY, THIRD_PARTY_FORM)
    try:
        tiled(x)
        paths.append(tiled.tiling.last_path)
        unregister_gated_form(THIRD_PARTY_BODY)
        tiled(x)
        paths.append(tiled.tiling.last_path)
    finally:
        unregister_gated_form(THIRD_PARTY_BODY)
        unregister_activation(THIRD_PARTY_ACTIVATION)
    assert paths == ["generic", "fast", "generic"]


class HoldsItsFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_an_activation_registered_by_the_attribute_holding_its_function():
    body = CodeForm("return self.fn({x})")
    register_activation(body, function_attribute="fn")
    try:
        assert recognised_activation(HoldsItsFunction(F.gelu)) == ("gelu", ("fn",))
        assert recognised_activation(HoldsItsFunction(torch.tanh)) == (None, ("fn",))  # not one the kernel computes
    finally:
        unregister_activation(body)
    assert recognised_activation(HoldsItsFunction(F.gelu)) == (None, ())


def test_an_equivalent_linear_is_accepted_only_while_registered_and_its_modules_own(monkeypatch):
    def my_linear(input, weight, bias=None):
        return F.linear(input, weight, bias)

    my_linear.__module__ = "third_party.linear"
    monkeypatch.setitem(sys.modules, "third_party.linear", types.SimpleNamespace(my_linear=my_linear))
    assert not linear_is_a_linear(my_linear)
    register_equivalent_linear("third_party.linear", "my_linear")
    try:
        assert linear_is_a_linear(my_linear)
        monkeypatch.setitem(sys.modules, "third_party.linear", types.SimpleNamespace(my_linear=F.linear))
        assert not linear_is_a_linear(my_linear)  # no longer that module's own function
    finally:
        unregister_equivalent_linear("third_party.linear", "my_linear")


class CountingKernel(NativeGatedActivation):
    calls = 0

    def forward_mul(self, g, u):
        CountingKernel.calls += 1
        return super().forward_mul(g, u)


def test_a_registered_fused_kernel_is_used_on_its_device_type_exactly():
    from reference import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(HIDDEN, INTER).double()
    kernel = register_fused_kernel("cpu", ("silu",), CountingKernel)
    try:
        assert _path_and_check(mlp) == "fast"
        assert CountingKernel.calls > 0
    finally:
        unregister_fused_kernel(kernel)
    CountingKernel.calls = 0
    assert _path_and_check(GatedMLP(HIDDEN, INTER).double()) == "fast"
    assert CountingKernel.calls == 0


@pytest.mark.parametrize("register, error", [
    (lambda: register_gated_form("return self.down_proj({x})", GatedForm()), TypeError),  # not a CodeForm
    (lambda: register_gated_form(CodeForm("return self.down_proj({x}"), GatedForm()), ValueError),  # no ")"
    (lambda: register_gated_form(THIRD_PARTY_BODY, GatedForm(gate_up="gate_up_proj")), ValueError),  # both
    (lambda: register_gated_form(THIRD_PARTY_BODY, "down_proj"), TypeError),
    (lambda: register_activation("return F.silu({x})", computes="silu"), TypeError),  # not a CodeForm
    (lambda: register_activation(THIRD_PARTY_ACTIVATION), ValueError),  # neither
    (lambda: register_activation(THIRD_PARTY_ACTIVATION, computes="silu", function_attribute="act"), ValueError),
    (lambda: register_activation(THIRD_PARTY_ACTIVATION, computes="relu"), ValueError),
    (lambda: register_activation(THIRD_PARTY_ACTIVATION, function_attribute="not a name"), ValueError),
    (lambda: register_equivalent_linear("", "my_linear"), TypeError),
    (lambda: register_fused_kernel("cuda", ("relu",), CountingKernel), ValueError),
    (lambda: register_fused_kernel(0, ("silu",), CountingKernel), TypeError),  # a device type is named
])
def test_bad_registrations_are_refused_before_anything_is_registered(register, error):
    from tiled_mlp.core import gated_forms
    from tiled_mlp.core.kernels import gated as activations

    before = (list(gated_forms.KNOWN_BODIES), list(gated_forms._ACTIVATION_BODIES),
              set(gated_forms._EQUIVALENT_LINEARS), list(activations._FUSED))
    with pytest.raises(error):
        register()
    assert before == (list(gated_forms.KNOWN_BODIES), list(gated_forms._ACTIVATION_BODIES),
                      set(gated_forms._EQUIVALENT_LINEARS), list(activations._FUSED))


def test_a_fused_kernel_registered_or_withdrawn_reaches_a_module_already_called():
    from reference import GatedMLP

    from tiled_mlp import TiledMLP

    torch.manual_seed(0)
    tiled = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    CountingKernel.calls = 0
    tiled(x).sum().backward()
    assert tiled.tiling.last_path == "fast" and CountingKernel.calls == 0
    kernel = register_fused_kernel("cpu", ("silu",), CountingKernel)
    try:
        tiled(x).sum().backward()
        assert CountingKernel.calls > 0, "a kernel registered after the first call is not used"
    finally:
        unregister_fused_kernel(kernel)
    CountingKernel.calls = 0
    tiled(x).sum().backward()
    assert CountingKernel.calls == 0, "a withdrawn kernel still runs in a module called before"


def test_use_fused_kernel_switched_after_a_call_is_honoured():
    from reference import GatedMLP

    from tiled_mlp import TiledMLP

    torch.manual_seed(0)
    tiled = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    kernel = register_fused_kernel("cpu", ("silu",), CountingKernel)
    try:
        CountingKernel.calls = 0
        tiled(x).sum().backward()
        assert CountingKernel.calls > 0
        tiled.tiling.use_fused_kernel = False  # the kept plan chose the fused kernel: it must not stay
        CountingKernel.calls = 0
        tiled(x).sum().backward()
        assert tiled.tiling.last_path == "fast" and CountingKernel.calls == 0, "the fused kernel still runs"
    finally:
        unregister_fused_kernel(kernel)
