"""The strategy registry: third-party strategies, names, instances, priorities, unregistering."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from reference import GatedMLP, assert_runs_close, fresh_inputs, seeded, tiled_run, untiled_run

from tiled_mlp import Strategy, TiledMLP, available_strategies, get_strategy, register_strategy, unregister_strategy
from tiled_mlp.strategies import SingleDeviceStrategy

pytestmark = pytest.mark.timeout(30)

HIDDEN, INTER, TOKENS = 8, 12, 7


class MarkedMLP(GatedMLP):
    """A module a third-party backend recognises by a marker."""

    claimed_by_test = True


class RecordingStrategy(Strategy):
    """Claims marked modules and records that its ``gathered`` context was entered."""

    name = "test_recording"
    priority = 50
    gathers_params = True  # declared: the call enters ``gathered`` only where it is
    entered = []

    @classmethod
    def claims(cls, module, ancestors=()):
        return getattr(module, "claimed_by_test", False)

    @contextlib.contextmanager
    def gathered(self, module):
        type(self).entered.append(type(module).__name__)
        yield


@pytest.fixture
def recording():
    RecordingStrategy.entered = []
    register_strategy(RecordingStrategy)
    try:
        yield RecordingStrategy
    finally:
        if RecordingStrategy.name in available_strategies():
            unregister_strategy(RecordingStrategy.name)


def test_builtins_are_registered():
    assert {"single_device", "fsdp1", "fsdp2"} <= set(available_strategies())


def test_auto_picks_a_claiming_third_party_strategy(recording):
    mlp = seeded(MarkedMLP, 0, HIDDEN, INTER)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert isinstance(tiled.tiling.last_strategy, RecordingStrategy)
    # Once around the forward's shard loop, once around the backward recompute.
    assert recording.entered == ["TiledMarkedMLP", "TiledMarkedMLP"]
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_auto_skips_it_when_it_does_not_claim(recording):
    tiled = TiledMLP(GatedMLP(HIDDEN, INTER), num_shards=2)
    tiled(torch.randn(1, TOKENS, HIDDEN))
    assert isinstance(tiled.tiling.last_strategy, SingleDeviceStrategy)
    assert recording.entered == []


def test_lower_priority_loses_to_the_builtin_backends_but_beats_the_fallback(recording):
    class Lower(RecordingStrategy):
        name = "test_lower"
        priority = -200  # below single_device's fallback

    register_strategy(Lower)
    try:
        tiled = TiledMLP(MarkedMLP(HIDDEN, INTER), num_shards=2)
        tiled(torch.randn(1, TOKENS, HIDDEN))
        assert type(tiled.tiling.last_strategy) is RecordingStrategy
    finally:
        unregister_strategy("test_lower")


@pytest.mark.timeout(60)
def test_a_claims_that_needs_a_process_group_is_asked_only_while_one_is_initialised(tmp_path):
    # A subclass that writes its own claims is asked as any other (the mark belongs to the function). In a
    # process of its own: initialising and destroying the default group is global state.
    code = (
        "import torch, torch.distributed as dist\n"
        "from reference import GatedMLP\n"
        "from tiled_mlp import Strategy, TiledMLP, register_strategy\n"
        "from tiled_mlp.strategies import claims_need_process_group\n"
        "class NeedsProcessGroup(Strategy):\n"
        "    name, priority, asked = 'test_needs_process_group', 50, 0\n"
        "    @classmethod\n"
        "    @claims_need_process_group\n"
        "    def claims(cls, module, ancestors=()):\n"
        "        NeedsProcessGroup.asked += 1\n"
        "        return True\n"
        "class OwnClaims(NeedsProcessGroup):\n"
        "    name, priority = 'test_own_claims', 40\n"
        "    @classmethod\n"
        "    def claims(cls, module, ancestors=()):\n"
        "        return True\n"
        "register_strategy(NeedsProcessGroup)\n"
        "register_strategy(OwnClaims)\n"
        f"tiled = TiledMLP(GatedMLP({HIDDEN}, {INTER}), num_shards=2)\n"
        f"tiled(torch.randn(1, {TOKENS}, {HIDDEN}))\n"
        "assert type(tiled.tiling.last_strategy) is OwnClaims, tiled.tiling.last_strategy\n"
        "assert NeedsProcessGroup.claims(tiled) is False\n"
        "assert NeedsProcessGroup.asked == 0, NeedsProcessGroup.asked\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        f"tiled(torch.randn(1, {TOKENS}, {HIDDEN}))\n"
        "dist.destroy_process_group()\n"
        "assert NeedsProcessGroup.asked == 1, NeedsProcessGroup.asked\n"
        "assert type(tiled.tiling.last_strategy) is NeedsProcessGroup, tiled.tiling.last_strategy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50, cwd=os.path.dirname(__file__))


def test_strategy_by_name_instance_and_class(recording):
    mlp = seeded(GatedMLP, 1, HIDDEN, INTER)  # not marked: only an explicit choice selects it
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(mlp, x, dy)
    for choice in ("test_recording", RecordingStrategy(), RecordingStrategy):
        recording.entered = []
        got, tiled = tiled_run(mlp, x, dy, num_shards=2, strategy=choice)
        assert type(tiled.tiling.last_strategy) is RecordingStrategy
        assert len(recording.entered) == 2
        assert_runs_close(want, got)
    assert isinstance(get_strategy("test_recording"), RecordingStrategy)


def test_unregister(recording):
    unregister_strategy("test_recording")
    assert "test_recording" not in available_strategies()
    with pytest.raises(KeyError, match="available strategies"):
        unregister_strategy("test_recording")
    with pytest.raises(KeyError):
        TiledMLP(GatedMLP(HIDDEN, INTER), strategy="test_recording")
    tiled = TiledMLP(MarkedMLP(HIDDEN, INTER), num_shards=2)
    tiled(torch.randn(1, TOKENS, HIDDEN))
    assert isinstance(tiled.tiling.last_strategy, SingleDeviceStrategy)


def test_override_replaces_a_registered_name(recording):
    class Replacement(RecordingStrategy):
        name = "test_recording"

    register_strategy(Replacement, override=True)
    assert type(get_strategy("test_recording")) is Replacement
    register_strategy(RecordingStrategy, override=True)
    register_strategy(RecordingStrategy)  # the same class again is not a duplicate
    assert type(get_strategy("test_recording")) is RecordingStrategy


def test_register_works_as_a_decorator():
    @register_strategy
    class Decorated(Strategy):
        name = "test_decorated"

        @classmethod
        def claims(cls, module, ancestors=()):
            return False

    try:
        assert type(get_strategy("test_decorated")) is Decorated
    finally:
        unregister_strategy("test_decorated")


class GateOnly(Strategy):
    """Says only gate_proj.weight receives gradients: both kernels must honour it (the fast kernel
    computes every projection, and once delivered all three)."""

    name = "test_gate_only"

    @classmethod
    def claims(cls, module, ancestors=()):
        return False

    def trainable_params(self, module):
        return [module.gate_proj.weight]


@pytest.mark.parametrize("path", ["fast", "generic"])
def test_trainable_params_decides_which_parameters_get_gradients_on_both_paths(path):
    mlp = seeded(GatedMLP, 2, HIDDEN, INTER)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    want = untiled_run(mlp, x, dy)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3, path=path, strategy=GateOnly())
    assert tiled.tiling.last_path == path
    assert [name for name, g in got.grads.items() if g is not None] == ["gate_proj.weight"]
    torch.testing.assert_close(got.grads["gate_proj.weight"], want.grads["gate_proj.weight"], rtol=1e-10, atol=0)
    torch.testing.assert_close(got.dx, want.dx, rtol=1e-10, atol=0)


class WhileRunningStrategy(Strategy):
    """Claims only while a flag is up, as DDP is seen only while its forward runs."""

    name = "test_while_running"
    priority = 900
    running = False

    @classmethod
    def claims(cls, module, ancestors=()):
        return cls.running


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpoint_recompute_inside_backward_keeps_the_forwards_strategy(reentrant):
    """The recompute runs inside the backward, where the backend's context is gone: it must use the
    backend the forward resolved (under DDP it reported, and behaved as, single_device)."""
    from torch.utils.checkpoint import checkpoint

    register_strategy(WhileRunningStrategy)
    try:
        mlp = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=2, path="generic")
        x = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
        WhileRunningStrategy.running = True
        out = checkpoint(mlp, x, use_reentrant=reentrant, preserve_rng_state=False)
        WhileRunningStrategy.running = False
        assert type(mlp.tiling.last_strategy) is WhileRunningStrategy
        mlp.tiling.last_strategy = None
        out.sum().backward()
        if reentrant:  # the recompute called the module again, inside the backward
            assert type(mlp.tiling.last_strategy) is WhileRunningStrategy
    finally:
        WhileRunningStrategy.running = False
        unregister_strategy(WhileRunningStrategy.name)
