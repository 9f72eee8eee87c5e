"""Strategies as configured instances, and optional capabilities as mixins.

- An instance carries its backend's configuration (a mesh, a process group) and is used as given.
- The registry stores constructor arguments; a name, and "auto", give instances built with them, and
  "auto" lets the claiming class read the rest from the runtime (``Strategy.configured_for``).
- The sequence-parallel questions belong to the ``SequenceParallelAware`` mixin: a strategy in play
  without it (one that claims the model, or one given to the loss) is refused, with an error naming it.
"""
from __future__ import annotations

from typing import Any, List

import pytest
import torch
from reference import GatedMLP, assert_runs_close, fresh_inputs, seeded, tiled_run, untiled_run

from tiled_mlp import Strategy, TiledMLP, available_strategies, get_strategy, register_strategy, unregister_strategy
from tiled_mlp.strategies import DDPStrategy, SequenceParallelAware, UnsupportedBackendError
from tiled_mlp.strategies.resolver import sums_over_sequence_ranks

pytestmark = pytest.mark.timeout(30)

HIDDEN, INTER, TOKENS = 8, 12, 7


class MeshMLP(GatedMLP):
    """A module a third-party tensor-parallel backend recognises, carrying the mesh it runs on."""

    runtime_mesh = "mesh-from-the-runtime"


class MeshStrategy(Strategy):
    """A backend whose instances need a mesh; "auto" reads it from the module it claims."""

    name = "test_mesh"
    priority = 60
    configures_from_runtime = True

    def __init__(self, mesh):
        self.mesh = mesh

    @classmethod
    def claims(cls, module, ancestors=()):
        return isinstance(module, MeshMLP)

    @classmethod
    def configured_for(cls, module, ancestors=(), **init_kwargs):
        init_kwargs.setdefault("mesh", module.runtime_mesh)
        return cls(**init_kwargs)


@pytest.fixture
def registered():
    """Registrations made by a test, removed after it."""
    names = []

    def register(cls, **kwargs):
        register_strategy(cls, **kwargs)
        names.append(kwargs.get("name", cls.name))

    yield register
    for name in names:
        if name in available_strategies():
            unregister_strategy(name)


def test_an_instance_with_arguments_is_used_as_given():
    mlp = seeded(GatedMLP, 0, HIDDEN, INTER)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    group = object()  # what the backend was built with, never looked into by the tiled call
    for given in (MeshStrategy(mesh="given-mesh"), DDPStrategy(process_group=group)):
        got, tiled = tiled_run(mlp, x, dy, num_shards=3, strategy=given)
        assert tiled.tiling.last_strategy is given
        assert_runs_close(untiled_run(mlp, x, dy), got)
    assert DDPStrategy(process_group=group).process_group is group


def test_the_registry_builds_instances_with_the_stored_arguments(registered):
    registered(MeshStrategy, mesh="stored-mesh")
    assert get_strategy("test_mesh").mesh == "stored-mesh"
    mlp = seeded(GatedMLP, 1, HIDDEN, INTER)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=2, strategy="test_mesh")
    assert type(tiled.tiling.last_strategy) is MeshStrategy and tiled.tiling.last_strategy.mesh == "stored-mesh"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_auto_returns_an_instance_configured_for_the_module(registered):
    registered(MeshStrategy)
    mlp = seeded(MeshMLP, 2, HIDDEN, INTER)
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got, tiled = tiled_run(mlp, x, dy, num_shards=3)
    assert type(tiled.tiling.last_strategy) is MeshStrategy
    assert tiled.tiling.last_strategy.mesh == "mesh-from-the-runtime"
    assert_runs_close(untiled_run(mlp, x, dy), got)


def test_auto_keeps_the_registered_arguments_over_what_the_runtime_shows(registered):
    registered(MeshStrategy, mesh="stored-mesh")
    tiled = TiledMLP(MeshMLP(HIDDEN, INTER), num_shards=2)
    tiled(torch.randn(1, TOKENS, HIDDEN))
    assert tiled.tiling.last_strategy.mesh == "stored-mesh"


def test_one_class_registered_under_two_names_with_their_own_arguments(registered):
    registered(MeshStrategy, mesh="a")
    registered(MeshStrategy, name="test_mesh_b", mesh="b")
    first, second = get_strategy("test_mesh"), get_strategy("test_mesh_b")
    assert (first.name, first.mesh, second.name, second.mesh) == ("test_mesh", "a", "test_mesh_b", "b")
    with pytest.raises(ValueError, match="override=True"):  # other arguments under a held name
        register_strategy(MeshStrategy, mesh="c")
    register_strategy(MeshStrategy, mesh="a")  # the same registration again is not a duplicate


def test_arguments_the_constructor_cannot_take_are_refused_at_registration():
    with pytest.raises(TypeError, match="MeshStrategy's constructor cannot take the arguments registered"):
        register_strategy(MeshStrategy, mesh="m", colour="blue")
    assert "test_mesh" not in available_strategies()


def test_a_registration_missing_a_required_argument_is_refused_by_name_not_for_auto(registered):
    registered(MeshStrategy)  # "auto" reads its mesh from the module it claims
    with pytest.raises(TypeError, match=r"MeshStrategy cannot be built from its registration 'test_mesh' .*mesh"):
        TiledMLP(GatedMLP(HIDDEN, INTER), strategy="test_mesh")
    with pytest.raises(TypeError, match=r"pass an instance, strategy=MeshStrategy\(\.\.\.\)"):
        TiledMLP(GatedMLP(HIDDEN, INTER), strategy=MeshStrategy)


# -- the sequence-parallel capability ---------------------------------------------------------------
class Unaware(Strategy):
    """A third-party backend that claims marked models and says nothing about sequence parallelism."""

    name = "test_sp_unaware"
    priority = 70

    @classmethod
    def claims(cls, module, ancestors=()):
        return any(getattr(p, "_test_sp_marked", False) for p in module.parameters())


class Summing(SequenceParallelAware, Unaware):
    """The same backend, declaring that it sums its gradients over the SP ranks."""

    name = "test_sp_summing"

    def sums_over_sequence_ranks(self, module, group=None):
        return True


def marked_model() -> torch.nn.Module:
    model = GatedMLP(HIDDEN, INTER)
    for p in model.parameters():
        p._test_sp_marked = True
    return model


def test_a_claiming_strategy_without_the_sequence_parallel_capability_is_refused(registered):
    registered(Unaware)
    with pytest.raises(UnsupportedBackendError,
                       match=r"'test_sp_unaware' \(Unaware\) claims GatedMLP, but does not implement the "
                             r"SequenceParallelAware capability.*Derive Unaware from tiled_mlp.SequenceParallelAware"):
        sums_over_sequence_ranks(marked_model())
    # Registered but not in play (it claims nothing here): nothing to refuse, the built-ins answer.
    assert sums_over_sequence_ranks(GatedMLP(HIDDEN, INTER)) is False


def test_a_given_strategy_without_the_sequence_parallel_capability_is_refused():
    class GivenUnaware(Unaware):
        name = "test_given_unaware"

    with pytest.raises(UnsupportedBackendError, match="'test_given_unaware' .* was given as the strategy"):
        sums_over_sequence_ranks(GatedMLP(HIDDEN, INTER), strategy=GivenUnaware())


def test_a_strategy_with_the_capability_is_asked(registered):
    registered(Summing)
    assert sums_over_sequence_ranks(marked_model()) is True
    assert sums_over_sequence_ranks(GatedMLP(HIDDEN, INTER), strategy=Summing()) is True


def test_a_capability_method_that_cannot_take_the_call_is_refused_at_registration():
    class WrongArity(Summing):
        name = "test_sp_wrong_arity"

        def check_sequence_group(self, module):  # the resolver passes (module, group)
            return None

    with pytest.raises(TypeError, match=r"check_sequence_group must accept \(module, group\)"):
        register_strategy(WrongArity)


class Recording(Summing):
    """An aware backend that records which of its configured instances the SP check asks."""

    name = "test_sp_recording"
    asked: List[Any] = []

    def __init__(self, tag=None):
        self.tag = tag

    def sums_over_sequence_ranks(self, module, group=None):
        Recording.asked.append(self.tag)
        return True


def test_the_sp_check_asks_the_registration_auto_resolves_not_another_of_the_same_class(registered):
    registered(Recording, tag="auto's")
    registered(Recording, name="test_sp_recording_other", tag="named only")
    Recording.asked = []
    assert sums_over_sequence_ranks(marked_model()) is True
    assert Recording.asked == ["auto's"]


def test_a_registration_with_a_tensor_argument_can_be_repeated_and_overridden(registered):
    weight = torch.ones(3)
    registered(Recording, tag=weight)
    register_strategy(Recording, tag=weight)  # the same arguments, by identity: nothing to refuse
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(Recording, tag=torch.ones(3))
    register_strategy(Recording, override=True, tag=torch.zeros(3))
    assert get_strategy("test_sp_recording").tag.sum().item() == 0


def test_a_declared_gathered_is_entered_around_the_call_and_the_backward(monkeypatch):
    entered = []
    base = Strategy.gathered

    def spy(self, module):
        entered.append(type(module).__name__)
        return base(self, module)

    monkeypatch.setattr(Strategy, "gathered", spy)
    monkeypatch.setattr(Strategy, "gathers_params", True)  # a capability is used where it is declared
    tiled = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=2)
    tiled(torch.randn(1, 6, HIDDEN, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert entered == ["TiledGatedMLP", "TiledGatedMLP"]  # around the forward, and around the recompute


def test_auto_shares_the_instance_a_registration_builds_from_its_arguments_alone(registered):
    """A class without ``configures_from_runtime`` builds from the registered arguments alone: every call "auto"
    resolves to it shares one instance (as every call shares a fixed one); a class that declares it and reads
    the runtime in its own ``configured_for`` is built at every call."""

    class Fixed(Strategy):
        name, priority = "test_fixed_arguments", 70

        def __init__(self, mesh="stored"):
            self.mesh = mesh

        @classmethod
        def claims(cls, module, ancestors=()):
            return isinstance(module, MeshMLP) and not hasattr(module, "read_runtime")

    registered(Fixed)
    registered(MeshStrategy)
    x = torch.randn(1, TOKENS, HIDDEN)
    shared = [TiledMLP(MeshMLP(HIDDEN, INTER), num_shards=2) for _ in range(2)]
    for tiled in shared * 2:
        tiled(x)
    assert shared[0].tiling.last_strategy is shared[1].tiling.last_strategy
    assert type(shared[0].tiling.last_strategy) is Fixed
    runtime = TiledMLP(MeshMLP(HIDDEN, INTER), num_shards=2)
    runtime.read_runtime = True
    runtime(x)
    first = runtime.tiling.last_strategy
    runtime(x)
    assert type(first) is MeshStrategy and runtime.tiling.last_strategy is not first
