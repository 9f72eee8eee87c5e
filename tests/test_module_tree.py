"""The module tree a call plan rests on (``tiled_core/tiled_call.ModuleTree``) sees every change to the
module tree that the plan's answers depend on, and nothing else makes the plan be re-made: by default what a
training step can change (classes, forwards, registries, hooks, training modes, tensors' dtype and
``requires_grad``), in strict mode (``deep``) every attribute as well.

Each test takes a snapshot, changes one thing, and checks ``holds()``; the last ones check through a
tiled call that a stale plan is never used (the gradient goes to the parameter the module holds now).
"""
from __future__ import annotations

import copy

import pytest
import torch
from reference import GatedMLP, seeded
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.core.tiled_call import ModuleTree

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 8, 12, 7


@pytest.fixture(params=[False, True], ids=["default", "strict"])
def deep(request) -> bool:
    return request.param


def _mlp() -> GatedMLP:
    return seeded(GatedMLP, 3, HIDDEN, INTER, "silu")


def _same_hook(module, args, out):
    return None


def test_another_root_or_a_replaced_instance_dict_does_not_hold(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    # A shallow copy holds the same children, parameters and attributes, in a dict of its own.
    assert not snapshot.holds(copy.copy(mlp))
    for module in (mlp, mlp.up_proj):
        kept = module.__dict__
        module.__dict__ = dict(kept)  # equal contents, another dict: later writes go to it, not the snapshot's
        assert not snapshot.holds(mlp)
        module.__dict__ = kept
    assert snapshot.holds(mlp)


def test_an_unchanged_tree_holds(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    mlp(torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64))
    assert snapshot.holds(mlp)


def test_an_attribute_renamed_with_the_same_value_is_seen(deep):
    if not deep:
        pytest.skip("a plain attribute is compared in strict mode only")
    mlp = _mlp()
    value = object()
    mlp.first = value
    snapshot = ModuleTree(mlp, deep)
    del mlp.first
    mlp.second = value  # same size, same value in the same place: only the name differs
    assert not snapshot.holds(mlp)


def test_a_hook_removed_and_registered_again_is_seen(deep):
    mlp = _mlp()
    handle = mlp.up_proj.register_forward_hook(_same_hook)
    snapshot = ModuleTree(mlp, deep)
    handle.remove()
    mlp.up_proj.register_forward_hook(_same_hook, with_kwargs=True)  # the same function under a new handle
    assert not snapshot.holds(mlp)


def test_a_hook_on_a_child_whose_hooks_were_empty_is_seen(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    mlp.act_fn.register_forward_pre_hook(lambda module, args: None)
    assert not snapshot.holds(mlp)


def test_a_hook_written_under_its_handle_is_seen(deep):
    mlp = _mlp()
    handle = mlp.up_proj.register_forward_hook(_same_hook)
    snapshot = ModuleTree(mlp, deep)
    mlp.up_proj._forward_hooks[handle.id] = lambda module, args, out: out * 2  # no new handle id
    assert not snapshot.holds(mlp)


def test_children_renamed_in_the_same_order_by_direct_writes_are_seen_in_strict_mode(deep):
    # Below ``nn.Module``'s API no registration hook runs and the values keep their order: only the keys
    # differ, and default mode reads them after a registration only (a step of training never does this).
    if not deep:
        pytest.skip("a key renamed by a direct registry write is compared in strict mode only")
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    names, children = zip(*mlp._modules.items(), strict=True)
    names = tuple({"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(name, name) for name in names)
    mlp._modules.clear()
    mlp._modules.update(zip(names, children, strict=True))  # the same children in the same order: gate and up trade roles
    assert not snapshot.holds(mlp)


@pytest.mark.parametrize("how", ["setattr", "add_module", "register_parameter"])
def test_names_changed_through_the_module_api_are_seen(how, deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    if how == "setattr":  # gate and up trade roles: the values move too
        mlp.gate_proj, mlp.up_proj = mlp.up_proj, mlp.gate_proj
    elif how == "add_module":  # the same child under a second name: the values change
        mlp.add_module("gate_copy", mlp.gate_proj)
    else:  # a parameter renamed in its place: the values keep their order, only the keys differ
        held = mlp.up_proj._parameters
        kept = list(held.items())
        held.clear()
        mlp.up_proj.register_parameter("renamed", kept[0][1])
        held.update(kept[1:])
        assert list(held.values()) == [value for _, value in kept]
    assert not snapshot.holds(mlp)


def test_a_global_module_hook_is_seen(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    handle = nn.modules.module.register_module_forward_hook(_same_hook)
    try:
        assert not snapshot.holds(mlp)
    finally:
        handle.remove()
    assert snapshot.holds(mlp)


@pytest.mark.parametrize("change", ["dtype", "requires_grad", "parameter", "buffer", "training", "child"])
def test_a_change_inside_a_submodule_is_seen(change, deep):
    mlp = _mlp()
    mlp.down_proj.register_buffer("offset", torch.zeros(HIDDEN, dtype=torch.float64))
    snapshot = ModuleTree(mlp, deep)
    if change == "dtype":
        mlp.gate_proj.to(torch.float32)  # the same Parameter objects, another dtype
    elif change == "requires_grad":
        mlp.up_proj.weight.requires_grad_(False)
    elif change == "parameter":
        mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight.detach().clone())
    elif change == "buffer":
        mlp.down_proj.offset = torch.ones(HIDDEN, dtype=torch.float64)
    elif change == "training":
        mlp.act_fn.eval()
    else:
        mlp.act_fn = nn.GELU()
    assert not snapshot.holds(mlp)


def test_a_class_or_its_forward_changed_is_seen(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)

    class OtherSiLU(nn.SiLU):
        pass

    mlp.act_fn.__class__ = OtherSiLU
    assert not snapshot.holds(mlp)
    mlp.act_fn.__class__ = nn.SiLU
    assert snapshot.holds(mlp)
    OtherSiLU.forward = lambda self, x: x  # patched on a class in the tree
    mlp.act_fn.__class__ = OtherSiLU
    later = ModuleTree(mlp, deep)
    OtherSiLU.forward = lambda self, x: 2 * x
    assert not later.holds(mlp)


def test_a_parameter_swapped_after_a_fast_call_gets_the_gradient(deep):
    tiled = TiledMLP(_mlp(), num_shards=3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64)
    tiled(x).sum().backward()
    assert tiled.tiling.last_path == "fast"
    old = tiled.down_proj.weight
    tiled.down_proj.weight = nn.Parameter(old.detach() * 2)
    old.grad = None
    out = tiled(x)
    out.sum().backward()
    assert tiled.tiling.last_path == "fast"
    assert old.grad is None and tiled.down_proj.weight.grad is not None
    want = nn.functional.linear(
        tiled.act_fn(nn.functional.linear(x, tiled.gate_proj.weight)) * nn.functional.linear(x, tiled.up_proj.weight),
        tiled.down_proj.weight)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=0)


def test_a_direct_write_into_an_empty_registry_is_seen(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    mlp.act_fn._parameters["w"] = nn.Parameter(torch.ones(1, dtype=torch.float64))  # no registration hook runs
    assert not snapshot.holds(mlp)


def test_a_value_appended_to_the_last_registry_by_a_direct_write_is_seen(deep):
    mlp = _mlp()
    snapshot = ModuleTree(mlp, deep)
    # The end of the values compared by identity: the pairs before it all still match.
    mlp.gate_proj._parameters["extra"] = nn.Parameter(torch.ones(1, dtype=torch.float64))
    assert not snapshot.holds(mlp)


def test_a_called_module_converts_by_swapping_tensors():
    # ``Module.to`` swaps a DTensor's parameters (and every one with the future flag): torch.utils.swap_tensors
    # refuses a tensor something holds a weak reference to.
    tiled = TiledMLP(_mlp(), num_shards=3)
    x = torch.randn(2, TOKENS, HIDDEN, dtype=torch.float64)
    tiled(x)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        tiled.to(torch.float32)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    x32 = x.float()
    out = tiled(x32)
    assert tiled.tiling.last_path == "fast" and out.dtype == torch.float32
    torch.testing.assert_close(out, GatedMLP.forward(tiled, x32), rtol=1e-6, atol=1e-6)
