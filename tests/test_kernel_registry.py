"""Kernels are chosen from a registry, in priority order: a registered kernel runs ahead of the built-in
ones, and ``tiling.last_reason`` names the kernel that ran and why each one before it declined."""
from __future__ import annotations

import pytest
import torch
from reference import GatedMLP

from integration_tests.toy_kernel import NAME, NOT_MINE, TanhMLP, TanhMLPKernel
from tiled_mlp import Kernel, KernelCall, TiledMLP, available_kernels, register_kernel, unregister_kernel

ALWAYS_DECLINES = "it declines every call"


class Declining(Kernel):
    name = "test_declining"

    def why_not(self, call: KernelCall) -> str:
        return ALWAYS_DECLINES


@pytest.fixture
def registered():
    register_kernel(Declining(), priority=200)
    register_kernel(TanhMLPKernel())
    try:
        yield
    finally:
        unregister_kernel("test_declining")
        unregister_kernel(NAME)


def test_built_in_kernels_are_registry_entries_in_priority_order():
    assert available_kernels("map") == ["fast", "norm", "generic"]
    assert available_kernels("reduce") == ["vocab_parallel", "linear_head", "module_head"]


def test_a_registered_kernel_goes_ahead_of_the_built_in_ones(registered):
    assert available_kernels("map") == ["test_declining", NAME, "fast", "norm", "generic"]


def test_last_reason_names_the_kernel_and_why_the_earlier_ones_declined(registered):
    torch.manual_seed(0)
    toy = TiledMLP(TanhMLP(8, 20).double(), num_shards=3)
    toy(torch.randn(1, 10, 8, dtype=torch.float64))
    assert toy.tiling.last_path == NAME
    assert toy.tiling.last_reason == (f"tiled: num_shards=3 as configured; kernel {NAME!r} "
                                      f"('test_declining' declined: {ALWAYS_DECLINES})")
    gated = TiledMLP(GatedMLP(8, 20).double(), num_shards=2)
    gated(torch.randn(1, 10, 8, dtype=torch.float64))
    assert gated.tiling.last_path == "fast"
    assert gated.tiling.last_reason == ("tiled: num_shards=2 as configured; kernel 'fast' ('test_declining' declined: "
                                        f"{ALWAYS_DECLINES}; {NAME!r} declined: {NOT_MINE})")


def test_a_registered_kernel_is_exact_against_the_untiled_module(registered):
    torch.manual_seed(0)
    plain = TanhMLP(8, 20).double()
    tiled = TiledMLP(TanhMLP(8, 20).double(), num_shards=4)
    tiled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    x_tiled = x.detach().clone().requires_grad_(True)
    dy = torch.randn(2, 9, 8, dtype=torch.float64)
    out, out_tiled = plain(x), tiled(x_tiled)
    out.backward(dy)
    out_tiled.backward(dy)
    assert tiled.tiling.last_path == NAME and tiled.tiling.last_num_shards == 4
    torch.testing.assert_close(out_tiled, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_tiled.grad, x.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_path_generic_skips_a_registered_kernel(registered):
    toy = TiledMLP(TanhMLP(8, 20).double(), num_shards=2, path="generic")
    toy(torch.randn(1, 6, 8, dtype=torch.float64))
    assert toy.tiling.last_path == "generic"
    assert f"{NAME!r} declined: path='generic' was asked for" in toy.tiling.last_reason


def test_path_names_a_registered_kernel_and_only_it_is_asked(registered):
    toy = TiledMLP(TanhMLP(8, 20).double(), num_shards=2, path=NAME)
    toy(torch.randn(1, 6, 8, dtype=torch.float64))
    assert toy.tiling.last_path == NAME
    assert "'test_declining' declined: path=" in toy.tiling.last_reason
    gated = TiledMLP(GatedMLP(8, 20).double(), num_shards=2, path=NAME)  # the named kernel declines it
    with pytest.raises(RuntimeError, match=f"{NAME!r} declined: {NOT_MINE}"):
        gated(torch.randn(1, 6, 8, dtype=torch.float64))


def test_path_naming_no_registered_kernel_is_refused_before_tiling_and_at_a_call_after_unregistering():
    with pytest.raises(ValueError, match="path must be one of"):
        TiledMLP(TanhMLP(8, 20), path=NAME)  # not registered here
    register_kernel(TanhMLPKernel())
    try:
        toy = TiledMLP(TanhMLP(8, 20).double(), num_shards=2, path=NAME)
    finally:
        unregister_kernel(NAME)
    with pytest.raises(RuntimeError, match="names no registered kernel now"):
        toy(torch.randn(1, 6, 8, dtype=torch.float64))


def test_registry_refuses_a_taken_name_a_nameless_kernel_and_an_unknown_one():
    with pytest.raises(ValueError, match="registered already"):
        register_kernel(_named("fast"))
    with pytest.raises(ValueError, match="has no name"):
        register_kernel(Kernel())
    with pytest.raises(ValueError, match="shape must be one of"):
        register_kernel(_named("test_bad_shape", shape="scan"))
    with pytest.raises(KeyError, match="no kernel named"):
        unregister_kernel("test_never_registered")
    with pytest.raises(TypeError, match="Kernel instance"):
        register_kernel(TanhMLPKernel)  # the class, not an instance
    with pytest.raises(TypeError, match="priority must be an int"):
        register_kernel(_named("test_bad_priority"), priority=True)
    assert "test_bad_priority" not in available_kernels()


def _named(name: str, shape: str = "map") -> Kernel:
    kernel = Kernel()
    kernel.name, kernel.shape = name, shape
    return kernel


def test_a_kernel_declaring_a_wrong_output_width_is_refused_not_broadcast():
    """A declared width sizes the output before the first shard; a shard whose output does not fit its rows is
    refused (a one-wide output would otherwise be broadcast into eight columns in silence)."""
    from torch import nn

    from integration_tests.toy_kernel import TanhShardKernel

    class OneWide(TanhMLP):
        def __init__(self):
            super().__init__(8, 20)
            self.fc2 = nn.Linear(20, 1)

    class ClaimsEight(TanhShardKernel):
        name = "test_claims_eight"

        def output_width(self, tensors):
            return 8

    register_kernel(ClaimsEight)
    try:
        tiled = TiledMLP(OneWide().double(), num_shards=3, path="test_claims_eight")
        with pytest.raises(RuntimeError, match=r"forward returned rows of shape \(6, 1\) for rows of shape \(6, 8\)"):
            tiled(torch.randn(2, 9, 8, dtype=torch.float64))
    finally:
        unregister_kernel("test_claims_eight")


class CountingDecline(Kernel):
    """Declines every call and counts how often it was asked; ``answers_per_plan`` as given."""

    name = "test_counting"

    def __init__(self, answers_per_plan: bool):
        self.answers_per_plan = answers_per_plan
        self.asked = 0

    def why_not(self, call: KernelCall) -> str:
        self.asked += 1
        return ALWAYS_DECLINES


def _asked_per_call(answers_per_plan: bool, calls: int = 3) -> int:
    kernel = register_kernel(CountingDecline(answers_per_plan), priority=200)
    try:
        gated = TiledMLP(GatedMLP(8, 20).double(), num_shards=2)
        x = torch.randn(1, 6, 8, dtype=torch.float64)
        for _ in range(calls):
            gated(x)
            assert gated.tiling.last_path == "fast"
        return kernel.asked
    finally:
        unregister_kernel("test_counting")


def test_a_choice_made_only_by_kernels_answering_per_plan_is_remembered_while_the_plan_holds():
    """The gated kernel answers per plan: with another such kernel ahead of it, both are asked once over three
    calls; a kernel that does not say so (the default) is asked at every call, and so is every kernel then."""
    assert _asked_per_call(answers_per_plan=True) == 1
    assert _asked_per_call(answers_per_plan=False) == 3


def test_a_remembered_choice_is_made_again_when_the_kernels_or_the_module_change():
    gated = TiledMLP(GatedMLP(8, 20).double(), num_shards=2)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    gated(x)
    assert gated.tiling.last_path == "fast"
    register_kernel(TanhMLPKernel(), priority=200)  # registered after the first call: asked at the next
    try:
        gated(x)
        assert f"{NAME!r} declined: {NOT_MINE}" in gated.tiling.last_reason
    finally:
        unregister_kernel(NAME)
    gated(x)
    assert NAME not in gated.tiling.last_reason
    gated.up_proj.register_forward_hook(lambda *args: None)  # a hook the fast kernel would skip
    gated(x)
    assert gated.tiling.last_path == "generic"
