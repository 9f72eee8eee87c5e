"""The norm kernel and its custom op (``tiled_mlp::rms_norm``): a tiled Hugging Face RMSNorm whose forward is a
registered body runs the body's own operations per shard, eagerly and as one op under ``torch.compile``.

Against the untiled module: float64 output, input gradient and weight gradient; bf16 output and input
gradient bit for bit. Gemma computes in float32 whatever the input: its weight gradient is checked against
the module's own per-token products summed in float64 (the untiled module sums them in float32). A forward
that is not a registered body (patched, edited, torch's ``nn.RMSNorm``) declines to the generic kernel.
A tiny Llama with tiled MLPs and norms traces as one graph with no break, and its compiled float64 loss and
every parameter's gradient equal the untiled model's.
"""
from __future__ import annotations

import copy

import pytest
import torch
from reference import laid_out

from integration_tests.dynamo_versions import traced_as_ops

pytest.importorskip("transformers")

from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from integration_tests.tiny_models import VOCAB, grads_by_key, tiny_model  # noqa: E402
from tiled_mlp.core import TiledMLP, norm_forms  # noqa: E402
from tiled_mlp.core.code_forms import CodeForm  # noqa: E402
from tiled_mlp.core.norm_forms import NormForm  # noqa: E402
from tiled_mlp.core.ops import rms_norm  # noqa: E402
from tiled_mlp.integrations import apply_tiled_mlp  # noqa: E402
from tiled_mlp.integrations.norms import NORM_ACCUM_DTYPE, TiledNorm  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_dynamo")]

HIDDEN = 16
BOUND = 1e-12
NORMS = {"llama": LlamaRMSNorm, "gemma": GemmaRMSNorm, "gemma3": Gemma3RMSNorm}


def _norm_of(name: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    norm = NORMS[name](HIDDEN, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()  # neither Llama's ones nor Gemma's zeros: every product matters
    return norm


def _norm_inputs(dtype: torch.dtype, seed: int = 1, shape=(2, 13, HIDDEN)):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))


def _norm_run(module, x, dy, call=None):
    xi = x.clone().requires_grad_()
    y = (call or module)(xi)
    y.backward(dy)
    return y.detach(), xi.grad, module.weight.grad


def _tiled_norm(norm, num_shards=3):
    return TiledNorm(copy.deepcopy(norm), num_shards=num_shards, grad_accum_dtype=NORM_ACCUM_DTYPE)


def _gemma_weight_grad(norm, x, dy):
    """The module's own per-token products (``dy.float() * normed``, float32 as its autograd forms them),
    summed in float64."""
    normed = norm._norm(x.float())
    return (dy.float() * normed).double().sum((0, 1))


# -- the op ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["contiguous", "transposed"])
@pytest.mark.parametrize("multiply,offset", [("input_dtype", 0.0), ("float32", 1.0)])
def test_opcheck(multiply, offset, memory):
    # A transposed input too: the fake kernels must give the strides the ops return (a contiguous gradient).
    x, dy = _norm_inputs(torch.float64)
    x, dy = laid_out(x, memory), laid_out(dy, memory)
    weight = torch.randn(HIDDEN, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(rms_norm, (x.requires_grad_(), weight, 1e-5, offset, multiply, 3, torch.float32))
    torch.library.opcheck(torch.ops.tiled_mlp.rms_norm_backward.default,
                          (dy, x.detach(), weight.detach(), 1e-5, offset, multiply, 3, torch.float32, [True, True]))


@pytest.mark.parametrize("name", list(NORMS))
def test_the_op_equals_the_module_in_float64(name):
    norm = _norm_of(name, torch.float64)
    x, dy = _norm_inputs(torch.float64)
    want = _norm_run(norm, x, dy)
    form = ("input_dtype", 0.0) if name == "llama" else ("float32", 1.0)
    eps = norm.variance_epsilon if name == "llama" else norm.eps
    have_norm = copy.deepcopy(norm)
    have_norm.weight.grad = None
    have = _norm_run(have_norm, x, dy, lambda xi: rms_norm(xi, have_norm.weight, eps, form[1], form[0], 4, torch.float32))
    assert torch.equal(have[0], want[0]) and torch.equal(have[1], want[1])
    want_dw = want[2] if name == "llama" else _gemma_weight_grad(norm, x, dy)
    assert (have[2] - want_dw).abs().max().item() < BOUND


# -- eager: the norm kernel ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [1, 3, 26])
@pytest.mark.parametrize("name", list(NORMS))
def test_tiled_norm_equals_the_module_in_float64(name, num_shards):
    norm = _norm_of(name, torch.float64)
    tiled = _tiled_norm(norm, num_shards)
    x, dy = _norm_inputs(torch.float64)
    want, have = _norm_run(norm, x, dy), _norm_run(tiled, x, dy)
    assert tiled.tiling.last_path == "norm" and tiled.tiling.last_num_shards == num_shards
    assert torch.equal(have[0], want[0]), "the forward is the body's own op sequence"
    assert torch.equal(have[1], want[1]), "the input gradient is autograd's through the same sequence"
    want_dw = want[2] if name == "llama" else _gemma_weight_grad(norm, x, dy)
    assert (have[2] - want_dw).abs().max().item() < BOUND


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(NORMS))
def test_bf16_output_and_input_gradient_are_bit_for_bit(name, weight_dtype):
    """A bf16 input with a bf16 or float32 weight (Llama's output is then float32: the promoted dtype)."""
    norm = _norm_of(name, weight_dtype)
    tiled = _tiled_norm(norm)
    x, _ = _norm_inputs(torch.bfloat16, shape=(3, 40, HIDDEN))
    y = norm(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
    want, have = _norm_run(norm, x, dy), _norm_run(tiled, x, dy)
    assert tiled.tiling.last_path == "norm"
    assert have[0].dtype == want[0].dtype and torch.equal(have[0], want[0])
    assert torch.equal(have[1], want[1])
    # The weight gradient is summed in float32 (the untiled one rounds every product to the weight's dtype).
    exact = (dy.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5))).sum((0, 1))
    assert have[2].dtype == weight_dtype
    assert (have[2].double() - exact).abs().max() <= (want[2].double() - exact).abs().max() + 1e-2


class _ClampedLlamaNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        return super().forward(hidden_states).clamp(-1.0, 1.0)


class _EditedLlamaNorm(LlamaRMSNorm):
    """Llama's body with one edit (eps outside the rsqrt): another code object."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance) + self.variance_epsilon
        return self.weight * hidden_states.to(input_dtype)


def _declines(norm, x) -> str:
    tiled = TiledMLP(norm, num_shards=2)
    norm(x)
    assert tiled.tiling.last_path == "generic"
    return tiled.tiling.last_reason


@pytest.mark.parametrize("make", [lambda: _ClampedLlamaNorm(HIDDEN), lambda: _EditedLlamaNorm(HIDDEN),
                                  lambda: torch.nn.RMSNorm(HIDDEN)], ids=["subclass", "edited", "torch-rmsnorm"])
def test_an_unregistered_forward_declines_to_generic(make):
    """torch's ``nn.RMSNorm`` declines too: its forward calls ``F.rms_norm``, whose dtypes are aten's
    (no body of operations to run per shard), so the generic kernel runs it."""
    x, _ = _norm_inputs(torch.float64)
    assert "'norm' declined: its forward is not one the norm kernel is known to compute" in _declines(make().double(), x)


def test_a_patched_helper_an_integer_eps_and_a_class_weight_decline(monkeypatch):
    x, _ = _norm_inputs(torch.float64)
    norm = _norm_of("gemma3", torch.float64)
    norm.eps = 1
    assert "eps is not a plain float (int)" in _declines(norm, x)

    class Patched(Gemma3RMSNorm):
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

    assert "its method _norm is not the one" in _declines(Patched(HIDDEN).double(), x)

    class ClassEps(LlamaRMSNorm):  # a class attribute the forward's read could find instead of the instance's
        variance_epsilon = 0.5

    class OwnLookup(LlamaRMSNorm):
        def __getattribute__(self, name):
            return super().__getattribute__(name)

    for cls in (ClassEps, OwnLookup):
        assert "its class defines weight or variance_epsilon, or a custom attribute lookup" in _declines(
            cls(HIDDEN).double(), x), cls
    monkeypatch.setattr(torch, "rsqrt", lambda t: 1 / torch.sqrt(t))
    assert "its forward is not one the norm kernel" in _declines(_norm_of("llama", torch.float64), x)


def test_autocast_declines():
    norm = _norm_of("llama", torch.float32)
    tiled = TiledMLP(norm, num_shards=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiled(torch.randn(2, 8, HIDDEN))
    assert tiled.tiling.last_path == "generic" and "autocast is enabled" in tiled.tiling.last_reason


def _with_child(norm):
    norm.extra = torch.nn.Identity()
    return norm


def _with_second_parameter(norm):
    norm.bias = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=norm.weight.dtype))
    return norm


def _with_plain_weight(norm):
    weight = norm.weight.detach()
    del norm.weight
    norm.weight = weight
    return norm


def _with_2d_weight(norm):
    norm.weight = torch.nn.Parameter(norm.weight.detach().reshape(1, HIDDEN))
    return norm


def _with_instance_helper(norm):
    norm._norm = norm._norm  # the class's method, bound, shadowing it in the instance's dict
    return norm


@pytest.mark.parametrize("name, change, reason", [
    ("llama", _with_child, "it has submodules"),
    ("llama", _with_second_parameter, "it has parameters besides weight"),
    ("llama", _with_plain_weight, "weight is not a Parameter of the module"),
    ("llama", _with_2d_weight, "weight is 2-D"),
    ("gemma3", _with_instance_helper, "an instance attribute replaces the method _norm"),
], ids=["submodule", "second-parameter", "plain-weight", "2d-weight", "instance-helper"])
def test_a_norm_whose_attributes_are_not_the_forms_declines_with_the_reason(name, change, reason):
    """The registered body alone does not prove the norm: the attributes it reads must be what the form says."""
    x, _ = _norm_inputs(torch.float64)
    assert reason in _declines(change(_norm_of(name, torch.float64)), x)


_ANY_BODY = CodeForm("return {x}")


@pytest.mark.parametrize("body, form, error, message", [
    ("return {x}", NormForm(), TypeError, "takes a CodeForm body"),
    (_ANY_BODY, "weight", TypeError, "takes a NormForm"),
    (_ANY_BODY, NormForm(multiply="bfloat16"), ValueError, "NormForm.multiply is one of"),
    (_ANY_BODY, NormForm(eps="variance epsilon"), ValueError, "NormForm names attributes"),
    (_ANY_BODY, NormForm(offset=True), TypeError, "NormForm.offset is a number"),
    (_ANY_BODY, NormForm(helpers=(("not a name", _ANY_BODY),)), ValueError, "a helper is named by a method name"),
    (_ANY_BODY, NormForm(helpers=(("_norm", CodeForm("return ({x}")),)), ValueError, "not a method body"),
], ids=["body", "form", "multiply", "eps-name", "offset", "helper-name", "helper-body"])
def test_a_bad_norm_form_is_refused_before_it_is_registered(body, form, error, message):
    before = list(norm_forms._BODIES)
    with pytest.raises(error, match=message):
        norm_forms.register_norm_form(body, form)
    assert norm_forms._BODIES == before


def test_the_op_refuses_an_unknown_multiply_dtype():
    """The op is callable by anyone (``torch.ops.tiled_mlp.rms_norm``): a dtype name the formula does not know
    is refused, not read as float32."""
    x, _ = _norm_inputs(torch.float64)
    with pytest.raises(ValueError, match="a norm multiplies in one of"):
        rms_norm(x, torch.ones(HIDDEN, dtype=torch.float64), 1e-5, 0.0, "bfloat16", 2, None)


# -- compiled -------------------------------------------------------------------------------------------
def _tiny_llama_tiled():
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=2, norms=True)
    return reference, tiled


@traced_as_ops
def test_a_tiny_llama_with_tiled_norms_traces_as_one_graph():
    _, tiled = _tiny_llama_tiled()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(tiled)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    norms = [m for n, m in tiled.named_modules() if n.endswith("layernorm") or n == "model.norm"]
    assert len(norms) == 5
    assert all("tiled_mlp::rms_norm" in m.tiling.compiled_reason and m.tiling.last_path == "norm" for m in norms)


@traced_as_ops
def test_compiled_tiny_llama_equals_the_untiled_model_in_float64():
    reference, tiled = _tiny_llama_tiled()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    compiled = torch.compile(tiled, backend="aot_eager", fullgraph=True)
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    have = compiled(input_ids=ids, labels=ids).loss
    have.backward()
    assert abs(have.item() - want.item()) < BOUND
    want_grads, have_grads = grads_by_key(reference), grads_by_key(tiled)
    assert want_grads.keys() == have_grads.keys()
    for key, grad in want_grads.items():
        assert (grad is None) == (have_grads[key] is None), key
        if grad is not None:
            assert (have_grads[key] - grad).abs().max().item() < BOUND, key


def test_a_tiled_norm_refuses_an_input_that_is_not_floating_point_before_any_kernel_is_asked():
    """The norm kernel asks nothing of the input's dtype: the call's input check refuses it first, for the norm
    as for every tiled module, and no kernel decision is made."""
    tiled = _tiled_norm(_norm_of("llama", torch.float32))
    with pytest.raises(TypeError, match="floating-point input"):
        tiled(torch.ones(2, 5, HIDDEN, dtype=torch.int64))
    assert tiled.tiling.last_path is None and tiled.tiling.call_plan is None
