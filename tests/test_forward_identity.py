"""What a tiled call takes the module's forward to be, and what it must never be fooled by (each
a way to compute something silently wrong, or to crash): a method of another module, code swapped
in place, a patched torch function, an attribute hiding a child, a wrapper of the tiled forward,
inference mode, a subclass of the tiled class. Each is exact against an untiled copy in float64."""
from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
import torch.nn.functional as F
from reference import GatedMLP, assert_runs_close, fresh_inputs, step
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.core import strict

pytestmark = pytest.mark.timeout(60)
HIDDEN, INTER, SHAPE = 8, 16, (2, 12, 8)


class LlamaLike(GatedMLP):
    """Llama's own body (a local, then its return), not reference.GatedMLP's one-line form."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    mlp = LlamaLike().double()
    return mlp, copy.deepcopy(mlp)


def _assert_same_step_on_path(untiled: nn.Module, tiled: nn.Module, path: str):
    x, dy = fresh_inputs(SHAPE, HIDDEN)
    want = step(untiled, x, dy)
    got = step(tiled, x, dy)
    assert tiled.tiling.last_path == path
    assert_runs_close(want, got)


def test_an_instance_forward_of_another_module_is_not_proven():
    mlp, untiled = _pair()
    other = LlamaLike().double()
    mlp.forward = other.forward  # computes with other's weights, untiled as tiled
    untiled.forward = other.forward
    _assert_same_step_on_path(untiled, TiledMLP(mlp, num_shards=3), "generic")


def test_code_swapped_in_place_is_decided_again():
    class Edited(LlamaLike):
        def forward(self, x):
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
            return down_proj

    def clamped(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)).clamp(max=0.1) * self.up_proj(x))

    torch.manual_seed(0)
    mlp = Edited().double()
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=3)
    _assert_same_step_on_path(mlp, tiled, "fast")
    Edited.forward.__code__ = clamped.__code__  # what IPython's autoreload does to an edited function
    _assert_same_step_on_path(mlp, tiled, "generic")


def test_a_patched_torch_function_is_not_the_fast_kernels(monkeypatch):
    # Torch functions patched after tiling are checked in strict mode (``tiled_core/strict.py``).
    monkeypatch.setattr(strict, "ON", True)
    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3)
    _assert_same_step_on_path(untiled, tiled, "fast")
    monkeypatch.setattr(F, "silu", lambda x, inplace=False: torch.tanh(x) * x)
    _assert_same_step_on_path(untiled, tiled, "generic")


def test_an_instance_attribute_hiding_a_child_is_not_fast():
    mlp, untiled = _pair()
    other = nn.Linear(HIDDEN, INTER, bias=False).double()
    for module in (mlp, untiled):
        module.__dict__["up_proj"] = other  # found before _modules["up_proj"]
    _assert_same_step_on_path(untiled, TiledMLP(mlp, num_shards=3), "generic")


def test_a_wrapper_of_the_tiled_forward_installed_after_tiling_runs_each_shard_once():
    """accelerate's add_hook_to_module: ``old = m.forward; m.forward = partial(new_forward, m)`` where
    new_forward calls ``old``, the tiled forward; removing the hook puts ``old`` back."""
    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3)
    calls = []

    def new_forward(module, *args):
        calls.append(args[0].shape[-2])
        return module._old_forward(*args)

    tiled._old_forward = tiled.forward
    tiled.forward = functools.partial(new_forward, tiled)
    _assert_same_step_on_path(untiled, tiled, "generic")
    assert calls and max(calls) < SHAPE[0] * SHAPE[1]  # the wrapper ran per shard, never recursing
    tiled.forward = tiled._old_forward
    assert tiled.tiling.instance_forward is None
    _assert_same_step_on_path(untiled, tiled, "fast")


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_inference_mode(path):
    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3, path=path)
    with torch.inference_mode():
        x = torch.randn(SHAPE, dtype=torch.float64)  # an inference tensor: it has no version counter
        got = tiled(x)
        want = untiled(x)
    assert tiled.tiling.last_path == path
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_hidden_states_by_keyword_through_a_subclass_of_the_tiled_class():
    """FSDP2's fully_shard swaps the class again, for a subclass of the tiled one."""
    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3)
    tiled.__class__ = type("WrappedAgain", (type(tiled),), {})
    x = torch.randn(SHAPE, dtype=torch.float64)
    torch.testing.assert_close(tiled(x=x), untiled(x), rtol=1e-12, atol=1e-12)


def test_an_unbound_function_as_instance_forward_fails_as_untiled():
    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3)
    for module in (untiled, tiled):
        module.forward = types.FunctionType(LlamaLike.forward.__code__, LlamaLike.forward.__globals__)
        with pytest.raises(TypeError):
            module(torch.randn(SHAPE, dtype=torch.float64))


def test_a_linear_replaced_by_something_else_is_not_fast_but_deepspeeds_own_is(monkeypatch):
    """DeepSpeed ZeRO-3 replaces F.linear process-wide with its own linear (still x @ W.T + b); any
    other replacement is not proven to be a linear."""
    import sys

    mlp, untiled = _pair()
    tiled = TiledMLP(mlp, num_shards=3)
    original = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: original(x, w, b) * 2)
    _assert_same_step_on_path(untiled, tiled, "generic")

    def zero3_linear_wrap(input, weight, bias=None):
        return original(input, weight, bias)

    zero3_linear_wrap.__module__ = "deepspeed.runtime.zero.linear"
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.linear",
                        types.SimpleNamespace(zero3_linear_wrap=zero3_linear_wrap))
    monkeypatch.setattr(F, "linear", zero3_linear_wrap)
    # A fresh module: a generic decision is cached while nothing in its key changes (safe: generic is exact).
    mlp, untiled = _pair()
    _assert_same_step_on_path(untiled, TiledMLP(mlp, num_shards=3), "fast")
