"""What a call's decision remembers between calls is fresh at the next call once anything it was formed
from changes: the auto policy's answer (its sizes, its module constants and rules), a configured shard
count, the call's length, the registered kernels."""
from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch
from reference import GatedMLP

from tiled_mlp import TiledMLP
from tiled_mlp.core import auto_shards
from tiled_mlp.core.auto_shards import MLPSize, auto_decision, remembered_auto_decision
from tiled_mlp.core.builtin_kernels import GenericEntry
from tiled_mlp.core.kernel_registry import Kernel, register_kernel, unregister_kernel

HIDDEN, INTERMEDIATE = 64, 176
# Sizes whose auto answers straddle the policy's thresholds (untiled by the floor, by the share, by
# "frees nothing", tiled), so that moving any constant moves some answer.
SIZES = [(tokens, hidden, intermediate, 3 * hidden * intermediate * bytes_, bytes_, generic)
         for tokens in (64, 1024, 2048, 8192, 65536)
         for hidden, intermediate in ((64, 176), (1024, 2816))
         for bytes_ in (2, 4)
         for generic in (None, 3 * hidden * intermediate * bytes_)]


def _fresh(num_tokens, hidden, intermediate, weight_bytes, element_bytes, generic):
    return auto_decision(num_tokens, MLPSize(hidden, intermediate, weight_bytes, element_bytes, generic))


def _constants():
    return sorted(name for name, value in vars(auto_shards).items()
                  if not name.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool))


def _passed_through_twice():
    """A module that auto runs untiled, called twice (the second call takes the remembered answer)."""
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE))
    x = torch.randn(1, 2048, HIDDEN)
    mlp(x)
    mlp(x)
    assert mlp.tiling.last_path == "untiled"
    return mlp, x


def _tiled_twice():
    """A module tiled in 4 shards, called twice (the second call takes the remembered decision)."""
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE), num_shards=4)
    x = torch.randn(1, 16, HIDDEN)
    mlp(x)
    mlp(x)
    return mlp, x


@pytest.mark.parametrize("name", _constants())
def test_a_policy_constant_set_between_calls_changes_the_remembered_answer(name, monkeypatch):
    before = {sizes: remembered_auto_decision(*sizes) for sizes in SIZES}
    value = getattr(auto_shards, name)
    moved = 0
    for new in (value * 4, value / 4 if isinstance(value, float) else max(1, value // 4)):
        monkeypatch.setattr(auto_shards, name, new)
        for sizes in SIZES:
            fresh = _fresh(*sizes)
            assert remembered_auto_decision(*sizes) == fresh, (name, new, sizes)
            moved += fresh != before[sizes]
    assert moved, f"no size here moves with {name}: the test would not see it forgotten"


def test_a_policy_rule_replaced_between_calls_changes_the_remembered_answer(monkeypatch):
    sizes = (2048, HIDDEN, INTERMEDIATE, 3 * HIDDEN * INTERMEDIATE * 4, 4, None)
    assert remembered_auto_decision(*sizes).num_shards is None  # under the saving floor
    monkeypatch.setattr(auto_shards, "estimated_saved_bytes", lambda *args: float(2**40))
    assert remembered_auto_decision(*sizes).num_shards == 2


@pytest.mark.parametrize("position", range(6))
def test_each_size_is_part_of_what_the_answer_is_remembered_by(position):
    base = [2048, 1024, 2816, 3 * 1024 * 2816 * 4, 4, None]
    # Each changed size moves the answer at these sizes (checked below): more tokens, a wider hidden size
    # or heavier weights (larger fixed bytes: under the share), a wider intermediate, wider elements,
    # the generic path's extra buffers.
    changed = {0: 8192, 1: 65536, 2: 11264, 3: 10 * 2**30, 4: 8, 5: 10 * 2**30}[position]
    other = list(base)
    other[position] = changed
    assert _fresh(*base) != _fresh(*other), "the changed size must move the answer"
    assert remembered_auto_decision(*base) == _fresh(*base)
    assert remembered_auto_decision(*other) == _fresh(*other)


def test_answers_for_ever_new_lengths_are_kept_within_the_bound(monkeypatch):
    """Varying sequence lengths (packing, padding-free batches) ask about a new size at nearly every step: the
    answers kept stay within the bound, and each is still the fresh answer."""
    monkeypatch.setattr(auto_shards, "_REMEMBERED_LIMIT", 4)
    for tokens in range(1000, 1010):
        sizes = (tokens, 1024, 2816, 3 * 1024 * 2816 * 4, 4, None)
        assert remembered_auto_decision(*sizes) == _fresh(*sizes)
        assert len(auto_shards._REMEMBERED) <= 4


def _floor_between_fp32_and_fp64(tokens):
    size = MLPSize(HIDDEN, INTERMEDIATE, 3 * HIDDEN * INTERMEDIATE * 4, 4)
    shards = auto_shards.shard_count(tokens, size)
    return 1.5 * auto_shards.estimated_saved_bytes(tokens, size, shards)


def test_a_module_passed_through_tiles_once_its_call_is_long_enough(monkeypatch):
    monkeypatch.setattr(auto_shards, "MIN_SAVED_BYTES", _floor_between_fp32_and_fp64(2048))
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE))
    mlp(torch.randn(1, 2048, HIDDEN))
    assert mlp.tiling.last_path == "untiled"
    mlp(torch.randn(1, 2048, HIDDEN))  # the remembered answer
    assert mlp.tiling.last_path == "untiled"
    mlp(torch.randn(1, 4096, HIDDEN))
    assert mlp.tiling.last_path == "fast" and mlp.tiling.last_num_shards == 4


def test_a_module_passed_through_tiles_once_its_floor_is_lowered(monkeypatch):
    mlp, x = _passed_through_twice()
    monkeypatch.setattr(auto_shards, "MIN_SAVED_BYTES", 0)
    mlp(x)
    assert mlp.tiling.last_path == "fast" and mlp.tiling.last_num_shards == 2


def test_each_untiled_call_reports_its_own_reason():
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE))
    mlp(torch.randn(1, 2048, HIDDEN))
    assert mlp.tiling.last_path == "untiled" and "floor" in mlp.tiling.last_reason
    mlp(torch.randn(1, 64, HIDDEN))
    assert mlp.tiling.last_path == "untiled" and "no more than its own buffers" in mlp.tiling.last_reason


def test_a_module_in_another_dtype_gets_a_fresh_answer(monkeypatch):
    """Twice the element bytes, twice the saving: over the floor set between the two."""
    monkeypatch.setattr(auto_shards, "MIN_SAVED_BYTES", _floor_between_fp32_and_fp64(2048))
    mlp, x = _passed_through_twice()
    mlp.double()
    mlp(x.double())
    assert mlp.tiling.last_path == "fast"


def test_a_shard_count_set_between_calls_is_the_next_calls():
    torch.manual_seed(0)
    plain = GatedMLP(HIDDEN, INTERMEDIATE).double()
    mlp = TiledMLP(copy.deepcopy(plain), num_shards=4)
    x = torch.randn(1, 16, HIDDEN, dtype=torch.float64)
    mlp(x)
    mlp(x)
    mlp.tiling.num_shards = 2
    out = mlp(x)
    assert mlp.tiling.last_num_shards == 2 and "num_shards=2" in mlp.tiling.last_reason
    torch.testing.assert_close(out, plain(x), rtol=0, atol=1e-12)


def test_a_longer_call_runs_over_all_its_tokens():
    torch.manual_seed(0)
    plain = GatedMLP(HIDDEN, INTERMEDIATE).double()
    mlp = TiledMLP(copy.deepcopy(plain), num_shards=4)
    short, long = (torch.randn(1, tokens, HIDDEN, dtype=torch.float64, requires_grad=True) for tokens in (16, 40))
    mlp(short)
    mlp(short)
    out = mlp(long)
    torch.testing.assert_close(out, plain(long), rtol=0, atol=1e-12)
    dy = torch.randn_like(out)
    (dx,) = torch.autograd.grad(out, long, dy)
    (ref,) = torch.autograd.grad(plain(long), long, dy)
    torch.testing.assert_close(dx, ref, rtol=0, atol=1e-12)


class _Declines(Kernel):
    name = "declines_everything"

    def why_not(self, call):
        return "it never applies"


class _GenericAgain(GenericEntry):
    """Applies to every call: the built-in generic kernel under another name."""

    name = "generic_again"


@pytest.fixture
def registered():
    names = []

    def register(kernel):
        register_kernel(kernel)
        names.append(kernel.name)

    yield register
    for name in names:
        unregister_kernel(name)


def test_a_kernel_registered_between_calls_is_asked_at_the_next(registered):
    mlp, x = _tiled_twice()
    assert mlp.tiling.last_path == "fast"
    registered(_Declines())
    mlp(x)
    assert mlp.tiling.last_path == "fast"
    assert "'declines_everything' declined: it never applies" in mlp.tiling.last_reason


def test_a_kernel_that_applies_registered_between_calls_runs_the_next(registered):
    mlp, x = _tiled_twice()
    registered(_GenericAgain())
    mlp(x)
    assert mlp.tiling.last_path == "generic_again"
    assert mlp.tiling.last_reason.endswith("kernel 'generic_again'")


class _Recording(GenericEntry):
    """The generic kernel, built afresh for every call, each one noting that it ran."""

    name = "recording"

    def __init__(self):
        self.built, self.ran = [], []

    def build(self, call):
        kernel = super().build(call)
        forward_into = kernel.forward_into

        def recorded(*args, **kwargs):
            self.ran.append(kernel)
            return forward_into(*args, **kwargs)

        kernel.forward_into = recorded
        self.built.append(kernel)
        return kernel


def test_the_kernel_built_for_a_call_is_the_one_it_runs(registered):
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE), num_shards=4)
    x = torch.randn(1, 16, HIDDEN)
    recording = _Recording()
    registered(recording)
    mlp(x)
    mlp(x)
    assert len(recording.built) == 2 and recording.ran[-1] is recording.built[-1]


def test_a_kernel_built_for_one_call_is_not_kept_after_it(monkeypatch):
    """The generic kernel is built per call and holds what its call read (the first shard's RNG state among
    them): nothing remembered may keep it past the call's backward, not even until the collector runs."""
    from tiled_mlp.core import builtin_kernels

    built = []

    class Recorded(builtin_kernels.GenericShardKernel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(builtin_kernels, "GenericShardKernel", Recorded)
    torch.manual_seed(0)
    mlp = TiledMLP(GatedMLP(HIDDEN, INTERMEDIATE), num_shards=4, path="generic")
    x = torch.randn(1, 16, HIDDEN, requires_grad=True)
    gc.disable()
    try:
        for _ in range(2):
            mlp(x).sum().backward()
        assert len(built) == 2 and all(ref() is None for ref in built), [ref() for ref in built]
    finally:
        gc.enable()


def test_a_modules_decisions_for_ever_new_lengths_are_kept_within_the_bound(monkeypatch):
    """One decision per length, kept with the module's plan: lengths that change at every step stay within the
    bound, and each call is still exact."""
    tiled_call = importlib.import_module("tiled_mlp.core.tiled_call")
    monkeypatch.setattr(tiled_call, "_DECISIONS_LIMIT", 4)
    torch.manual_seed(0)
    plain = GatedMLP(HIDDEN, INTERMEDIATE).double()
    mlp = TiledMLP(copy.deepcopy(plain), num_shards=4)
    for tokens in range(16, 26):
        x = torch.randn(1, tokens, HIDDEN, dtype=torch.float64)
        torch.testing.assert_close(mlp(x), plain(x), rtol=0, atol=1e-12)
        assert mlp.tiling.last_num_shards == 4 and len(mlp.tiling.call_plan.decisions) <= 4
