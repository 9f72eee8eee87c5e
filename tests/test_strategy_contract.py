"""The strategy contract checked before any call: declared capabilities, constructor arguments at
registration, and "auto" asking a layout-reading class once per layout of the module."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from reference import GatedMLP
from torch import nn

import tiled_mlp
from tiled_mlp import Strategy, TiledMLP, available_strategies, register_strategy, unregister_strategy
from tiled_mlp.strategies import SingleDeviceStrategy
from tiled_mlp.strategies.resolver import resolve_strategy

pytestmark = pytest.mark.timeout(30)


class _Claiming(Strategy):
    @classmethod
    def claims(cls, module, ancestors=()):
        return False


@pytest.mark.parametrize("flag, method", [("gathers_params", "gathered"), ("delivers_grads", "deliver_grads")])
def test_a_capability_method_without_its_flag_is_refused_when_the_class_is_defined(flag, method):
    body = {method: lambda self, *args: args[-1] if method == "deliver_grads" else contextlib.nullcontext()}
    with pytest.raises(TypeError, match=rf"Undeclared defines {method} but does not declare {flag} = True"):
        type("Undeclared", (_Claiming,), body)
    with pytest.raises(TypeError, match=rf"FlagOnly declares {flag} = True but does not define {method}"):
        type("FlagOnly", (_Claiming,), {flag: True})
    declared = type("Declared", (_Claiming,), {**body, flag: True, "name": "test_declared"})
    register_strategy(declared)
    unregister_strategy("test_declared")


def test_a_flag_set_after_the_class_was_defined_is_refused_at_registration():
    class Later(_Claiming):
        name = "test_flag_later"

    Later.delivers_grads = True
    with pytest.raises(TypeError, match="Later declares delivers_grads = True but does not define deliver_grads"):
        register_strategy(Later)
    assert "test_flag_later" not in available_strategies()


class NeedsMesh(_Claiming):
    """Builds from its registered arguments alone (the base ``configured_for``): its mesh must be registered."""

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


@pytest.mark.timeout(60)
def test_a_module_called_before_fully_shard_is_fsdp2s_after_it(tmp_path):
    """The mainstream case the layout check protects: a forward (a warm-up, a planner run) before the backend
    wraps the model must not pin the single-device strategy. In a process of its own: the default group is
    global state."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from reference import GatedMLP\n"
        "from tiled_mlp import TiledMLP\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "layer = torch.nn.Sequential(TiledMLP(GatedMLP(8, 12), num_shards=2))\n"
        "layer(torch.randn(1, 5, 8))\n"
        "assert layer[0].tiling.last_strategy.name == 'single_device', layer[0].tiling.last_strategy\n"
        "fully_shard(layer)\n"
        "layer(torch.randn(1, 5, 8))\n"
        "assert layer[0].tiling.last_strategy.name == 'fsdp2', layer[0].tiling.last_strategy\n"
        "dist.destroy_process_group()\n"
    )
    # The child imports the tiled_mlp this process runs (a checkout's, not another installed copy).
    root = os.path.dirname(os.path.dirname(os.path.realpath(tiled_mlp.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50, cwd=os.path.dirname(__file__), env=env)
