"""Plain Python values a tiled MLP's forward reads (``self.scale = 2.0``, ``GELU.approximate``, a module's
``training``), changed between its forward and its backward.

Untiled, autograd keeps what the forward computed with, so the gradients are those of the forward.
The generic path recomputes the forward in backward and would read the new value: it refuses, naming
the attribute and both values, in the words autograd uses for a tensor modified in place. The fast path
never reads the module again (its factors are fixed when the call is decided), so it is exact there.
"""
from __future__ import annotations

import copy

import pytest
import torch
from reference import GatedMLP, Run, assert_runs_close, fresh_inputs, step, untiled_run
from torch import nn

from tiled_mlp import TiledMLP, register_gated_mlp, unregister_gated_mlp
from tiled_mlp.core.strict import strict_mode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def strict():
    """The plain values a recompute reads again are compared in strict mode (``tiled_core/strict.py``)."""
    with strict_mode():
        yield

HIDDEN, INTER, TOKENS = 8, 20, 12
SHAPE = (2, TOKENS, HIDDEN)
CHANGED = "one of the values needed for gradient computation has been changed"


class ScaledMLP(GatedMLP):
    """A gated MLP with settings read in its forward: a scale, an optional clip and a pair of offsets."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.scale = 2.0
        self.clip = None
        self.offsets = (0.0, 0.5)
        self.note = 0  # never read by the forward: a backend's bookkeeping, say

    def forward(self, x):
        h = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.scale
        if self.clip is not None:
            h = h.clamp(-self.clip, self.clip)
        return h + self.offsets[1]


def _tiled_copy(mlp: nn.Module, path: str = "generic") -> nn.Module:
    return TiledMLP(copy.deepcopy(mlp), num_shards=3, path=path)


def _forward(module: nn.Module):
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=3)
    leaf = x.detach().clone().requires_grad_()
    return leaf, module(leaf), dy


@pytest.mark.parametrize("attribute, value, shown", [
    ("scale", 20.0, "scale of TiledScaledMLP is 20.0; expected 2.0 instead"),
    ("clip", 1.0, "clip of TiledScaledMLP is 1.0; expected None instead"),
    ("offsets", (0.0, 1.5), "offsets of TiledScaledMLP is (0.0, 1.5); expected (0.0, 0.5) instead"),
    ("scale", 2, "expected 2.0 instead"),  # an int computes differently on an integer tensor: changed
])
def test_a_value_the_forward_reads_changed_before_backward_is_refused_with_its_name(attribute, value, shown):
    torch.manual_seed(0)
    tiled = _tiled_copy(ScaledMLP().double())
    _, y, dy = _forward(tiled)
    assert tiled.tiling.last_path == "generic"
    setattr(tiled, attribute, value)
    with pytest.raises(RuntimeError, match=CHANGED) as error:
        y.backward(dy)
    assert shown in str(error.value)
    assert all(p.grad is None for p in tiled.parameters())


def test_a_submodule_value_is_named_by_its_qualified_name():
    torch.manual_seed(0)
    mlp = GatedMLP(HIDDEN, INTER, act="gelu_tanh").double()
    tiled = _tiled_copy(mlp)
    _, y, dy = _forward(tiled)
    tiled.act_fn.approximate = "none"
    with pytest.raises(RuntimeError, match="act_fn.approximate of TiledGatedMLP is 'none'; expected 'tanh'"):
        y.backward(dy)


class DropoutMLP(GatedMLP):
    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        return self.dropout(super().forward(x))


def test_switching_to_eval_between_forward_and_backward_is_refused():
    """The recompute in eval mode would drop the dropout the forward applied."""
    torch.manual_seed(0)
    tiled = _tiled_copy(DropoutMLP().double())
    _, y, dy = _forward(tiled)
    tiled.eval()
    with pytest.raises(RuntimeError, match=r"training of TiledDropoutMLP is False; expected True"):
        y.backward(dy)


@pytest.mark.parametrize("change", [
    pytest.param(lambda m: setattr(m, "scale", float("2.0")), id="rebound-to-an-equal-value"),
    pytest.param(lambda m: (setattr(m, "scale", 9.0), setattr(m, "scale", 2.0)), id="changed-and-changed-back"),
    pytest.param(lambda m: setattr(m, "note", 7), id="a-value-the-code-never-reads"),
    pytest.param(lambda m: setattr(m, "extra", 1.0), id="a-new-attribute"),
])
def test_values_the_forward_computed_with_are_exact(change):
    torch.manual_seed(0)
    mlp = ScaledMLP().double()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=4)
    want = untiled_run(mlp, x, dy)
    tiled = _tiled_copy(mlp)
    leaf = x.detach().clone().requires_grad_()
    y = tiled(leaf)
    change(tiled)
    y.backward(dy)
    assert_runs_close(want, step_result(tiled, leaf, y))


def step_result(module: nn.Module, leaf: torch.Tensor, y: torch.Tensor) -> Run:
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}
    return Run(y.detach(), leaf.grad, grads)


class ScaledGated(nn.Module):
    """A user's gated MLP with a factor read by name, declared to the fast path."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()
        self.out_scale = 0.75

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * self.out_scale


def test_the_fast_path_computes_the_gradient_of_the_forward_it_ran():
    """As untiled autograd: the factor the forward used, whatever it was changed to before backward."""
    register_gated_mlp(ScaledGated, down_scale="out_scale")
    try:
        torch.manual_seed(0)
        mlp = ScaledGated().double()
        x, dy = fresh_inputs(SHAPE, HIDDEN, seed=5)
        runs = []
        for module in (copy.deepcopy(mlp), _tiled_copy(mlp, path="fast")):
            leaf = x.detach().clone().requires_grad_()
            y = module(leaf)
            module.out_scale = 7.5
            y.backward(dy)
            runs.append(step_result(module, leaf, y))
        assert module.tiling.last_path == "fast"
        assert_runs_close(runs[0], runs[1])
        assert_runs_close(step(copy.deepcopy(mlp), x, dy), runs[1])  # and that is the forward's own gradient
    finally:
        unregister_gated_mlp(ScaledGated)


class ParentReadsChild(GatedMLP):
    """A parent whose forward reads a value held on its child."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.down_proj.out_scale = 2.0

    def forward(self, x):
        return super().forward(x) * self.down_proj.out_scale


def test_a_child_value_read_by_the_parent_changed_before_backward_is_refused():
    torch.manual_seed(0)
    tiled = _tiled_copy(ParentReadsChild().double())
    _, y, dy = _forward(tiled)
    tiled.down_proj.out_scale = 20.0
    with pytest.raises(RuntimeError, match=r"down_proj\.out_scale of TiledParentReadsChild is 20\.0; expected 2\.0"):
        y.backward(dy)


def _two_adapter_lora_mlp() -> nn.Module:
    peft = pytest.importorskip("peft")
    mlp = GatedMLP(HIDDEN, INTER).double()
    for name in ("default", "other"):
        config = peft.LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"], r=2, lora_alpha=4,
                                 init_lora_weights=False)  # random B: each adapter changes the output
        mlp = peft.inject_adapter_in_model(config, mlp, adapter_name=name)
    return mlp.double()


def _set_adapter(module: nn.Module, name: str) -> None:
    from peft.tuners.lora import LoraLayer
    for sub in module.modules():
        if isinstance(sub, LoraLayer):
            sub.set_adapter(name)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_switching_the_peft_adapter_between_forward_and_backward_is_refused():
    """PEFT holds the active adapter in a list, rebound by ``set_adapter``: the recompute would run the other."""
    torch.manual_seed(0)
    tiled = _tiled_copy(_two_adapter_lora_mlp())
    _, y, dy = _forward(tiled)
    assert tiled.tiling.last_path == "generic"
    _set_adapter(tiled, "other")
    with pytest.raises(RuntimeError, match=r"gate_proj\._active_adapter of TiledGatedMLP is another list"):
        y.backward(dy)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_a_peft_lora_mlp_left_alone_is_exact():
    torch.manual_seed(0)
    mlp = _two_adapter_lora_mlp()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=6)
    want = untiled_run(mlp, x, dy)
    tiled = _tiled_copy(mlp)
    leaf = x.detach().clone().requires_grad_()
    y = tiled(leaf)
    y.backward(dy)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(want, step_result(tiled, leaf, y))


class SetsUpOnce(GatedMLP):
    """A forward that sets itself up at its first call (bitsandbytes' ``compute_type_is_set``): the first
    call computes differently, on purpose, so that a shard recomputed with the other setting would show."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.set_up = False

    def forward(self, x):
        first = not self.set_up
        self.set_up = True
        return super().forward(x) * (3.0 if first else 1.0)


def test_a_value_the_forward_sets_once_is_set_before_every_shard_and_exact():
    """Every shard, the first one run again, computes with the value the forward set, as its recompute
    does: the gradients are those of the output, equal to an untiled module already set up."""
    torch.manual_seed(0)
    mlp = SetsUpOnce().double()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=7)
    set_up = copy.deepcopy(mlp)
    set_up.set_up = True
    want = untiled_run(set_up, x, dy)
    tiled = _tiled_copy(mlp)
    leaf = x.detach().clone().requires_grad_()
    y = tiled(leaf)
    y.backward(dy)
    assert tiled.set_up is True
    assert_runs_close(want, step_result(tiled, leaf, y))


class CountsCalls(GatedMLP):
    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * self.calls


def test_a_value_the_forward_changes_at_every_call_is_refused_at_the_forward():
    torch.manual_seed(0)
    tiled = _tiled_copy(CountsCalls().double())
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=8)
    with pytest.raises(RuntimeError, match=r"the forward of TiledCountsCalls changes calls at every call"):
        tiled(x.requires_grad_())



def test_a_forward_that_changes_its_values_is_refused_without_a_graph_too():
    """No graph, no recompute, but each shard would still compute with another count (one output, three
    functions of the input): refused under no_grad as with a graph."""
    torch.manual_seed(0)
    tiled = _tiled_copy(CountsCalls().double())
    x, _ = fresh_inputs(SHAPE, HIDDEN, seed=8)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"changes calls at every call"):
        tiled(x)


class ReadsItsDevice(GatedMLP):
    """A forward that rebinds a device attribute to an equal, new ``torch.device`` object at every call
    (``torch.device`` and ``torch.Size`` are made anew at each read)."""

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.compute_device = torch.device("cpu")
        self.shape_seen = torch.Size([0])

    def forward(self, x):
        self.compute_device, self.shape_seen = x.device, x.shape[-1:]
        return super().forward(x.to(self.compute_device)) * len(self.shape_seen)


def test_equal_immutable_values_rebound_by_the_forward_are_not_a_change():
    torch.manual_seed(0)
    mlp = ReadsItsDevice().double()
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=9)
    want = untiled_run(copy.deepcopy(mlp), x, dy)
    tiled = _tiled_copy(mlp)
    leaf = x.detach().clone().requires_grad_()
    y = tiled(leaf)
    y.backward(dy)
    assert_runs_close(want, step_result(tiled, leaf, y))


def _gained(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h * module.gain


class HelperReads(GatedMLP):
    """A forward that reads its setting through a helper of its file, inside a lambda, and a class default
    overridden on the instance."""

    clip = None

    def __init__(self):
        super().__init__(HIDDEN, INTER)
        self.gain = 2.0
        self.shift = 0.0

    def forward(self, x):
        h = (lambda t: t + self.shift)(_gained(self, super().forward(x)))
        return h if self.clip is None else h.clamp(-self.clip, self.clip)


@pytest.mark.parametrize("attribute, value, shown", [
    ("gain", 5.0, "gain of TiledHelperReads is 5.0; expected 2.0"),
    ("clip", 0.1, "clip of TiledHelperReads is 0.1; expected unset"),  # set on the instance over the class's
    ("shift", 1.0, "shift of TiledHelperReads is 1.0; expected 0.0"),  # read in a nested code object
])
def test_a_value_read_by_a_helper_or_set_over_a_class_default_is_refused(attribute, value, shown):
    torch.manual_seed(0)
    tiled = _tiled_copy(HelperReads().double())
    _, y, dy = _forward(tiled)
    setattr(tiled, attribute, value)
    with pytest.raises(RuntimeError, match=CHANGED) as error:
        y.backward(dy)
    assert shown in str(error.value)
