"""What a tiled call keeps (``tiled_core/tiled_call.MapPlan``) is re-decided when what it rests on changes.

Each test makes a first call (which caches the fast decision), changes one thing the fast kernel
would not see, and checks that the next call follows the change: the fast path is left where it no
longer computes the module, and the result is the untiled module's. A cache keyed on too little fails
them by reusing the stale fast decision. What only a rare configuration changes (an attribute written into
an instance dict past ``nn.Module.__setattr__``, a class or torch function patched after tiling) is seen in
strict mode (``tiled_core/strict.py``), and those tests run in it.
"""
from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from reference import GatedMLP, assert_runs_close, fresh_inputs, seeded, tiled_run, untiled_run
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.core import untile
from tiled_mlp.core.strict import strict_mode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def strict():
    with strict_mode():
        yield

HIDDEN, INTER, TOKENS = 8, 12, 7


def _tiled_after_a_fast_call(seed: int = 11):
    mlp = seeded(GatedMLP, seed, HIDDEN, INTER, "silu")
    tiled = TiledMLP(mlp, num_shards=3)
    x, _ = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    tiled(x)
    assert tiled.tiling.last_path == "fast"
    return tiled


def _run(module, x, dy):
    x_in = x.detach().clone().requires_grad_()
    out = module(x_in)
    out.backward(dy)
    return out.detach(), x_in.grad


def _assert_matches_untiled(tiled, expect_path: str):
    x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    got = _run(tiled, x, dy)
    assert tiled.tiling.last_path == expect_path
    want = _run(untile(copy.deepcopy(tiled)), x, dy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=0)


def test_a_global_module_hook_sends_the_call_to_generic_and_fires_for_each_projection():
    """``register_module_forward_hook`` fires at every submodule call; the fast kernel makes none."""
    tiled = _tiled_after_a_fast_call()
    seen = []

    def record(module, args, out):
        seen.append(type(module).__name__)

    handle = nn.modules.module.register_module_forward_hook(record)
    try:
        x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
        _run(tiled, x, dy)
        assert tiled.tiling.last_path == "generic"
        # 3 shards in the forward and again in the recompute: gate, up, act, down each time, then the MLP.
        assert seen.count("Linear") == 3 * 3 * 2 and seen.count("SiLU") == 3 * 2
    finally:
        handle.remove()
    _assert_matches_untiled(tiled, "fast")  # the hook gone: fast again


def test_a_global_hook_registered_before_tiling_rules_out_the_fast_path_from_the_start():
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        mlp = seeded(GatedMLP, 3, HIDDEN, INTER, "silu")
        x, dy = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
        want = untiled_run(mlp, x, dy)
        got, tiled = tiled_run(mlp, x, dy, num_shards=3)
        assert tiled.tiling.last_path == "generic"
        assert_runs_close(want, got)
    finally:
        handle.remove()


class ScaledSiLU(nn.SiLU):
    """An activation whose forward reads a plain setting."""

    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return super().forward(x) * self.scale


def test_a_setting_rebound_after_a_fast_call_is_seen():
    mlp = seeded(GatedMLP, 4, HIDDEN, INTER, "silu")
    mlp.act_fn = ScaledSiLU()
    tiled = TiledMLP(mlp, num_shards=3)
    x, _ = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    tiled(x)
    first = tiled.tiling.last_path
    tiled.act_fn.scale = 3.0  # the fast kernel's SiLU has no scale: only the generic path is right now
    _assert_matches_untiled(tiled, "generic")
    assert first in ("fast", "generic")


def test_a_tensor_attribute_added_after_a_fast_call_is_seen():
    class Offset(GatedMLP):
        def forward(self, x):
            out = super().forward(x)
            offset = self.__dict__.get("offset")
            return out if offset is None else out + offset

    mlp = seeded(Offset, 5, HIDDEN, INTER, "silu")
    tiled = TiledMLP(mlp, num_shards=3)
    x, _ = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    tiled(x)
    # Its forward is not a known gated body (it reads ``__dict__``): never the fast path, so nothing
    # added later can be skipped.
    assert tiled.tiling.last_path == "generic"
    tiled.offset = torch.full((HIDDEN,), 0.5, dtype=torch.float64)
    _assert_matches_untiled(tiled, "generic")


def test_a_child_swapped_after_a_fast_call_is_seen():
    tiled = _tiled_after_a_fast_call(6)
    tiled.act_fn = nn.GELU()  # a real activation change: the fast kernel must now compute GELU or step aside
    _assert_matches_untiled(tiled, "fast")
    assert tiled.tiling.call_plan.fast[0].activation.name == "gelu"


@pytest.mark.usefixtures("strict")
def test_an_instance_attribute_hiding_a_child_after_a_fast_call_is_seen():
    # The fast decision's own staleness check reads only the class: the plan's snapshot of the module's
    # dicts must see an instance attribute that the forward now reads instead of the registered child.
    tiled = _tiled_after_a_fast_call(8)
    # Into the instance dict directly: nn.Module.__setattr__ would replace the registered child instead.
    tiled.__dict__["up_proj"] = seeded(nn.Linear, 9, HIDDEN, INTER, bias=False)
    _assert_matches_untiled(tiled, "generic")
    assert "hides the submodule up_proj" in tiled.tiling.last_reason


@pytest.mark.parametrize("state", ["its own (copy.copy)", "handed over"])
def test_a_shallow_copy_hiding_a_child_is_seen(state):
    tiled = _tiled_after_a_fast_call(12)
    twin = copy.copy(tiled)
    if state == "handed over":  # the original's state, and so its plan and snapshot, on the copy
        twin.__dict__["tiling"] = tiled.tiling
    twin.__dict__["up_proj"] = seeded(nn.Linear, 13, HIDDEN, INTER, bias=False)
    _assert_matches_untiled(twin, "generic")
    _assert_matches_untiled(tiled, "fast")


def test_a_shallow_copy_tiles_on_its_own():
    # ``copy.copy`` shares the module's registries (torch's shallow copy) but not its tiling: its own
    # configuration, plan and report, so two copies called in turn keep their plans.
    tiled = _tiled_after_a_fast_call(17)
    twin = copy.copy(tiled)
    assert twin.tiling is not tiled.tiling and twin.tiling.call_plan is None
    assert (twin.tiling.num_shards, twin.tiling.path) == (tiled.tiling.num_shards, tiled.tiling.path)
    assert twin.up_proj is tiled.up_proj
    x, _ = fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)
    twin(x)
    plans = tiled.tiling.call_plan, twin.tiling.call_plan
    twin.tiling.num_shards = 2
    tiled(x)
    twin(x)
    assert (tiled.tiling.last_num_shards, twin.tiling.last_num_shards) == (3, 2)
    assert tiled.tiling.call_plan is plans[0]  # not re-made after the twin's call
    _assert_matches_untiled(twin, "fast")
    _assert_matches_untiled(tiled, "fast")


def test_an_instance_dict_replaced_after_a_fast_call_is_seen():
    tiled = _tiled_after_a_fast_call(14)
    replaced = dict(tiled.__dict__)
    replaced["up_proj"] = seeded(nn.Linear, 15, HIDDEN, INTER, bias=False)
    tiled.__dict__ = replaced
    _assert_matches_untiled(tiled, "generic")
    child = tiled.gate_proj
    child.__dict__ = {**child.__dict__, "_parameters": {"weight": nn.Parameter(torch.randn(INTER, HIDDEN, dtype=torch.float64)),
                                                        "bias": None}}
    _assert_matches_untiled(tiled, "generic")


def _doubled_weight(linear):
    return linear._parameters["weight"] * 2


@pytest.mark.parametrize("change", ["activation class attribute", "projection class attribute",
                                    "projection class attribute lookup", "torch's attribute lookup",
                                    "projection call", "projection module global"])
@pytest.mark.usefixtures("strict")
def test_a_child_class_changed_after_a_fast_call_is_seen(monkeypatch, change):
    # The snapshot sees each child's class by identity, not what is added to that class later: the fast
    # decision's staleness check must read the children's classes as well as the module's.
    mlp = seeded(GatedMLP, 16, HIDDEN, INTER, "gelu")
    tiled = TiledMLP(mlp, num_shards=3)
    tiled(fresh_inputs((2, TOKENS, HIDDEN), HIDDEN)[0])
    assert tiled.tiling.last_path == "fast"
    if change == "activation class attribute":  # GELU's forward now reads "tanh": not what was proven
        monkeypatch.setattr(nn.GELU, "approximate", property(lambda self: "tanh"), raising=False)
    elif change == "projection class attribute":  # found before the registered parameter
        monkeypatch.setattr(nn.Linear, "weight", property(_doubled_weight), raising=False)
    elif change == "projection class attribute lookup":  # the lookup the registered parameter is found by
        original = nn.Module.__getattr__
        monkeypatch.setattr(nn.Linear, "__getattr__",
                            lambda self, name: _doubled_weight(self) if name == "weight" else original(self, name),
                            raising=False)
    elif change == "torch's attribute lookup":  # nn.Module's own, as the forward finds its children
        original, tanh = nn.Module.__getattr__, nn.Tanh()
        monkeypatch.setattr(nn.Module, "__getattr__", lambda self, name: tanh if name == "act_fn" else original(self, name))
    elif change == "projection call":  # the root's forward calls each child through its class's __call__
        call = nn.Module.__call__
        monkeypatch.setattr(nn.Linear, "__call__", lambda self, *args, **kwargs: 2 * call(self, *args, **kwargs),
                            raising=False)
    else:  # the module global nn.Linear's forward calls F.linear through
        linear_module = sys.modules[nn.Linear.__module__]
        monkeypatch.setattr(linear_module, "F", types.SimpleNamespace(linear=lambda x, w, b: 2 * F.linear(x, w, b)))
    _assert_matches_untiled(tiled, "generic")
    monkeypatch.undo()
    # A refused decision is not re-made for a class restored (the generic path stays exact).
    _assert_matches_untiled(tiled, "generic")


def test_train_eval_toggle_keeps_exact_results():
    tiled = _tiled_after_a_fast_call(7)
    tiled.eval()
    _assert_matches_untiled(tiled, "fast")
    tiled.train()
    _assert_matches_untiled(tiled, "fast")


def test_pass_through_reuses_the_plan_and_a_long_call_still_tiles():
    """num_shards="auto": a short call passes through on the kept plan, without a new walk; a long call after
    it still tiles, and both match the untiled module."""
    mlp = seeded(GatedMLP, 8, 64, 1024, "silu", dtype=torch.float32)
    tiled = TiledMLP(mlp)
    short = torch.randn(1, 8, 64)
    tiled(short)
    assert tiled.tiling.last_path == "untiled"
    plan = tiled.tiling.call_plan
    tiled(short)
    assert tiled.tiling.last_path == "untiled" and tiled.tiling.call_plan is plan
    long = torch.randn(1, 8192, 64, requires_grad=True)
    out = tiled(long)
    assert tiled.tiling.last_path == "fast" and tiled.tiling.last_num_shards > 1
    out.sum().backward()


def test_replaced_parameters_are_not_kept_alive_by_short_calls():
    """load_state_dict(assign=True) replaces the parameter objects; a module that then only runs short
    (passed-through) calls must not keep the old ones alive through its cached plan."""
    import gc
    import weakref

    mlp = seeded(GatedMLP, 8, 64, 1024, "silu", dtype=torch.float32)
    tiled = TiledMLP(mlp)
    tiled(torch.randn(1, 8192, 64))  # a tiled call: a full plan is cached
    assert tiled.tiling.last_path == "fast" and tiled.tiling.call_plan is not None
    old = [weakref.ref(p) for p in tiled.parameters()]
    tiled.load_state_dict({k: v.clone() for k, v in tiled.state_dict().items()}, assign=True)
    tiled(torch.randn(1, 8, 64))
    assert tiled.tiling.last_path == "untiled"
    gc.collect()
    assert all(ref() is None for ref in old)


def test_strict_mode_switched_after_a_call_makes_the_plan_again():
    with strict_mode(False):
        tiled = _tiled_after_a_fast_call()
        default_plan = tiled.tiling.call_plan
    with strict_mode(True):
        _assert_matches_untiled(tiled, "fast")
        strict_plan = tiled.tiling.call_plan
    assert strict_plan is not default_plan, "a plan made by default would skip strict mode's checks"
    with strict_mode(False):
        _assert_matches_untiled(tiled, "fast")
        assert tiled.tiling.call_plan is not strict_plan, "a strict plan kept would check strict mode's reads"


def test_the_autocast_dtype_switched_between_calls_is_the_one_the_backward_replays():
    # The plan keys on the whole autocast state and its runs carry it: a bf16 plan kept for a float16 call would
    # recompute that call's shards in bf16 (no error; gradients several times further from the untiled run).
    mlp = seeded(GatedMLP, 5, 64, 96, "silu").float()
    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=4, path="generic")  # the fast path refuses autocast
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        runs = []
        for module in (tiled, mlp):
            module.zero_grad()
            x_in = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=dtype):
                out = module(x_in)
            out.float().backward(dy)  # outside autocast, as a training loop's backward
            runs.append([out.float(), x_in.grad, *(p.grad for p in module.parameters())])
        assert out.dtype == dtype
        error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*runs, strict=True))
        assert error < (6e-3 if dtype == torch.bfloat16 else 1.5e-3), (dtype, error)
