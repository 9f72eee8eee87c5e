"""The strategy contract checked before any call: declared capabilities, constructor arguments at
registration, and "auto" asking a layout-reading class once per layout of the module."""
from __future__ import annotations

import contextlib

import pytest
import torch
from reference import ClaimsNothing, GatedMLP
from torch import nn

from tiled_mlp import Strategy, TiledMLP, available_strategies, register_strategy, unregister_strategy
from tiled_mlp.strategies import SingleDeviceStrategy
from tiled_mlp.strategies.resolver import resolve_strategy

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("flag, method", [("gathers_params", "gathered"), ("delivers_grads", "deliver_grads"),
                                          ("configures_from_runtime", "configured_for")])
def test_a_capability_method_without_its_flag_is_refused_when_the_class_is_defined(flag, method):
    bodies = {"deliver_grads": lambda self, *args: args[-1], "gathered": lambda self, *args: contextlib.nullcontext(),
              "configured_for": classmethod(lambda cls, module, ancestors=(), **kwargs: cls(**kwargs))}
    body = {method: bodies[method]}
    with pytest.raises(TypeError, match=rf"Undeclared defines {method} but does not declare {flag} = True"):
        type("Undeclared", (ClaimsNothing,), body)
    with pytest.raises(TypeError, match=rf"FlagOnly declares {flag} = True but does not define {method}"):
        type("FlagOnly", (ClaimsNothing,), {flag: True})
    declared = type("Declared", (ClaimsNothing,), {**body, flag: True, "name": "test_declared"})
    register_strategy(declared)
    unregister_strategy("test_declared")


def test_a_flag_set_after_the_class_was_defined_is_refused_at_registration():
    class Later(ClaimsNothing):
        name = "test_flag_later"

    Later.delivers_grads = True
    with pytest.raises(TypeError, match="Later declares delivers_grads = True but does not define deliver_grads"):
        register_strategy(Later)
    assert "test_flag_later" not in available_strategies()


def test_a_priority_that_is_not_an_int_is_refused_at_registration():
    class Halfway(ClaimsNothing):
        name = "test_priority_float"
        priority = 0.5

    with pytest.raises(TypeError, match=r"Halfway.priority must be an int, got 0.5"):
        register_strategy(Halfway)
    assert "test_priority_float" not in available_strategies()


def test_with_the_single_device_fallback_unregistered_a_module_no_strategy_claims_is_refused():
    mlp = TiledMLP(GatedMLP(8, 12), num_shards=2)
    unregister_strategy("single_device")
    try:
        with pytest.raises(RuntimeError, match="no registered strategy claims the module"):
            resolve_strategy(mlp)
    finally:
        register_strategy(SingleDeviceStrategy)
    assert "single_device" in available_strategies()


class NeedsMesh(ClaimsNothing):
    """Builds from its registered arguments alone (no ``configures_from_runtime``): its mesh must be registered."""

    name = "test_needs_mesh"

    def __init__(self, mesh, *, group, colour="blue"):
        self.mesh, self.group, self.colour = mesh, group, colour


def test_a_registration_missing_required_constructor_arguments_is_refused_naming_them():
    with pytest.raises(TypeError, match=r"NeedsMesh's constructor needs mesh, group, which its registration "
                                        r"'test_needs_mesh' does not give: register_strategy\(NeedsMesh, mesh=\.\.\., "
                                        r"group=\.\.\.\)"):
        register_strategy(NeedsMesh)
    with pytest.raises(TypeError, match="needs group,"):
        register_strategy(NeedsMesh, mesh="m")
    assert "test_needs_mesh" not in available_strategies()
    register_strategy(NeedsMesh, mesh="m", group="g")
    try:
        assert TiledMLP(GatedMLP(4, 6), strategy="test_needs_mesh").tiling.fixed_strategy.group == "g"
    finally:
        unregister_strategy("test_needs_mesh")


class MarkedByLayout(Strategy):
    """Claims a module whose parameters carry a mark; its claims reads nothing else, and says so."""

    name = "test_marked_by_layout"
    priority = 80
    claims_from_layout = True
    asked = 0

    @classmethod
    def claims(cls, module, ancestors=()):
        cls.asked += 1
        return any(getattr(p, "_test_layout_mark", False) for p in module.parameters())


@pytest.fixture
def marked_by_layout():
    MarkedByLayout.asked = 0
    register_strategy(MarkedByLayout)
    yield MarkedByLayout
    unregister_strategy(MarkedByLayout.name)


def test_auto_asks_a_layout_class_once_per_layout_and_again_when_it_changes(marked_by_layout):
    module = GatedMLP(4, 6)
    for _ in range(3):
        assert type(resolve_strategy(module)) is SingleDeviceStrategy
    assert marked_by_layout.asked == 1
    module.up_proj.weight._test_layout_mark = True  # marked in place, as ZeRO marks its parameters
    assert type(resolve_strategy(module)) is MarkedByLayout
    assert type(resolve_strategy(module)) is MarkedByLayout
    assert marked_by_layout.asked == 2
    module.up_proj.weight = nn.Parameter(torch.zeros(6, 4))  # replaced, as fully_shard and FSDP1 replace them
    assert type(resolve_strategy(module)) is SingleDeviceStrategy
    module.down_proj = nn.Linear(6, 4)
    module.down_proj.weight._test_layout_mark = True
    assert type(resolve_strategy(module)) is MarkedByLayout
    assert type(resolve_strategy(module, ancestors=(nn.Sequential(),))) is MarkedByLayout
    assert marked_by_layout.asked == 5



def test_auto_sees_a_strategy_registered_or_unregistered_after_the_first_call():
    # "auto" keeps what it resolved while the registrations are the same object; a registration after the
    # module's first call must reach its next call, and its removal too.
    class ClaimsAll(ClaimsNothing):
        name, priority = "test_claims_all", 900

        @classmethod
        def claims(cls, module, ancestors=()):
            return True

    tiled = TiledMLP(GatedMLP(8, 20).double(), num_shards=2)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    tiled(x)
    assert tiled.tiling.last_strategy.name == "single_device"
    register_strategy(ClaimsAll)
    try:
        tiled(x)
        assert tiled.tiling.last_strategy.name == "test_claims_all"
    finally:
        unregister_strategy("test_claims_all")
    tiled(x)
    assert tiled.tiling.last_strategy.name == "single_device"


def test_an_instance_given_deliver_grads_without_the_flag_is_refused_at_its_first_call():
    # The class check cannot see a method set on an instance: the call checks the instance it runs.
    strategy = SingleDeviceStrategy()
    strategy.deliver_grads = lambda params, grads: grads  # type: ignore[method-assign]
    tiled = TiledMLP(GatedMLP(8, 20).double(), num_shards=2, strategy=strategy)
    with pytest.raises(TypeError, match="SingleDeviceStrategy defines deliver_grads but does not declare delivers_grads"):
        tiled(torch.randn(1, 6, 8, dtype=torch.float64))
