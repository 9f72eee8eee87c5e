"""FSDP2's own forward hooks on the loss's head are recognised by what they are: ``FSDPState``'s
``_pre_forward`` / ``_post_forward`` bound to a state (a unit of one module), or the wrappers ``fully_shard``
puts around them on each module of a unit of several (``functools.wraps``, then ``torch.compiler.disable``),
and only those of the state the head belongs to. A lookalike by name is a foreign hook, refused by the tiled
loss. The real hooks are exercised by the gloo tests (``integration_tests/test_fsdp2_head_unit.py``,
``integration_tests/test_framework_accelerate.py``)."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from tiled_mlp.strategies import fsdp2

pytestmark = pytest.mark.timeout(60)
FSDPState = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_state").FSDPState


def _as_grouped(method):
    """As ``fully_shard([a, b])`` registers a state's method on each module of the unit."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        return method(*args, **kwargs)
    return torch.compiler.disable(wrapped)


def test_a_states_own_forward_hooks_are_recognised_bare_or_wrapped():
    state = FSDPState()
    for hook in (state._pre_forward, state._post_forward, _as_grouped(state._pre_forward),
                 _as_grouped(state._post_forward)):
        assert fsdp2.fsdp2_forward_hook_state(hook) is state


def test_lookalikes_and_other_methods_are_not():
    class FakeState:  # same method names, not FSDP2's
        def _pre_forward(self, *args):
            return args

    def _post_forward(module, args, output):  # noqa: ARG001 - a hook's signature
        return output

    _post_forward.__qualname__ = "FSDPState._post_forward"  # a name proves nothing
    state = FSDPState()
    for hook in (FakeState()._pre_forward, _post_forward, _as_grouped(_post_forward), state._root_pre_forward,
                 lambda *args: None):
        assert fsdp2.fsdp2_forward_hook_state(hook) is None


def test_only_the_hooks_of_the_heads_own_unit_may_surround_the_loss(monkeypatch):
    head, own, other = nn.Linear(4, 5), FSDPState(), FSDPState()
    monkeypatch.setattr(fsdp2, "_state_of", lambda module: own if module is head else None)
    own._modules = (head,)  # as fully_shard(head) sets it
    strategy = fsdp2.FSDP2Strategy()
    owns_hook = strategy.head_call(head).owns_hook
    assert owns_hook(own._pre_forward)
    assert owns_hook(_as_grouped(own._post_forward))
    assert not owns_hook(other._pre_forward)
    assert not strategy.head_call(nn.Linear(4, 5)).owns_hook(own._pre_forward)


def test_a_head_in_a_unit_of_several_modules_is_called_with_a_stand_in(monkeypatch):
    head, norm = nn.Linear(4, 5), nn.LayerNorm(4)
    strategy = fsdp2.FSDP2Strategy()
    for modules, sees_graph in (((head,), True), ((norm, head), False), ((), True)):
        monkeypatch.setattr(fsdp2, "unit_modules", lambda module, modules=modules: modules)
        assert strategy.head_call(head).sees_graph is sees_graph


def test_a_mesh_of_more_than_two_dimensions_is_refused_when_the_strategy_is_built():
    class ThreeD:
        ndim = 3

    with pytest.raises(ValueError, match="1-D \\(shard\\) or 2-D \\(replicate, shard\\).*got a 3-D mesh"):
        fsdp2.FSDP2Strategy(mesh=ThreeD())
