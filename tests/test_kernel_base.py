"""The kernel base class: docs/architecture.md's kernel example, run verbatim, exact against the untiled module;
each slip a kernel author can make refused before it costs a gradient; the files a warm fast-path call runs in
this layer."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from integration_tests.toy_kernel import DOCS_KERNEL_NAME, docs_kernel_example, run_docs_kernel_example
from tests.reference import GatedMLP, assert_runs_close, step, untiled_run
from tiled_mlp import TiledMLP, register_kernel, unregister_kernel
from tiled_mlp.core.kernels import ShardKernel

EXAMPLE_NAME = DOCS_KERNEL_NAME


@pytest.fixture
def example():
    """The example's namespace, after it ran (it registers its kernel, unregistered afterwards)."""
    try:
        yield run_docs_kernel_example()
    finally:
        unregister_kernel(EXAMPLE_NAME)


def _seeded_tanh(namespace: dict):
    torch.manual_seed(0)
    return namespace["TanhMLP"](8, 20).double()


def _tanh_batch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    return x, torch.randn(2, 13, 8, dtype=torch.float64, generator=gen)


def test_the_docs_kernel_example_runs_and_is_exact_in_float64(example):
    """Outputs, input gradient and every parameter's gradient, against the same module untiled."""
    module = _seeded_tanh(example)
    x, dy = _tanh_batch()
    want = untiled_run(copy.deepcopy(module), x, dy)
    tiled = TiledMLP(module, num_shards=3)
    have = step(tiled, x, dy)
    assert tiled.tiling.last_path == EXAMPLE_NAME
    assert len(have.grads) == 4
    assert_runs_close(want, have, tol=1e-12, context="the docs' kernel example")


def test_the_docs_kernel_example_uses_at_most_five_concepts():
    """The example's kernel defines a name, a module type, forward_shard and backward_shard, and is registered:
    nothing else of the library is named."""
    code = docs_kernel_example()
    kernel = code[code.index("class TanhKernel"):code.index("register_kernel(TanhKernel)")]
    defined = set(re.findall(r"^    (\w+) =|^    def (\w+)", kernel, re.M))
    assert {a or b for a, b in defined} == {"name", "module_type", "forward_shard", "backward_shard"}


def test_a_kernel_whose_params_leave_out_the_biases_is_refused_before_any_work(example):
    class WeightsOnly(example["TanhKernel"]):
        name = "test_weights_only"

        def __init__(self, module):
            super().__init__(module)
            self.params = [module.fc1.weight, module.fc2.weight]

    register_kernel(WeightsOnly)
    try:
        tiled = TiledMLP(_seeded_tanh(example), num_shards=3, path="test_weights_only")
        x, _ = _tanh_batch()
        with pytest.raises(ValueError, match=r"leave out tensors the module trains \(fc1\.bias, fc2\.bias\)"):
            tiled(x)
        assert x.grad is None and all(p.grad is None for p in tiled.parameters())
    finally:
        unregister_kernel("test_weights_only")


def test_a_frozen_bias_left_out_of_params_is_not_refused(example):
    """Only what the module trains must be declared: a frozen bias gets no gradient either way."""
    class WeightsOnly(example["TanhKernel"]):
        name = "test_weights_only_frozen"

        def __init__(self, module):
            super().__init__(module)
            self.params = [module.fc1.weight, module.fc1.bias, module.fc2.weight, module.fc2.bias]

    register_kernel(WeightsOnly)
    try:
        module = _seeded_tanh(example)
        module.fc2.bias.requires_grad_(False)
        tiled = TiledMLP(module, num_shards=3, path="test_weights_only_frozen")
        x, dy = _tanh_batch()
        tiled(x).backward(dy)
        assert module.fc2.bias.grad is None and module.fc1.bias.grad is not None
    finally:
        unregister_kernel("test_weights_only_frozen")


def _tanh_grads(x, dy, tensors):
    w1, b1, w2, _ = tensors
    h = torch.tanh(F.linear(x, w1, b1))
    dz = (dy @ w2) * (1 - h * h)
    return dz, h


def test_a_backward_that_rebinds_the_input_gradient_buffer_is_refused(example):
    """The buffer form: a backward that assigns a new tensor to its ``grad_in`` name, instead of writing into
    it, and returns nothing, would leave the rows unwritten (uninitialised memory): refused."""
    class Rebinds(example["TanhKernel"]):
        name = "test_rebinds"

        def backward_into(self, x, dy, grad_in, grads, tensors, shard):
            dz, h = _tanh_grads(x, dy, tensors)
            grads.add(0, dz.t() @ x)
            grads.add(1, dz.sum(0))
            grads.add(2, dy.t() @ h)
            grads.add(3, dy.sum(0))
            grad_in = dz @ tensors[0]  # noqa: F841  # the slip: rebound, not written
            return None

    register_kernel(Rebinds)
    try:
        tiled = TiledMLP(_seeded_tanh(example), num_shards=3, path="test_rebinds")
        x, dy = _tanh_batch()
        out = tiled(x)
        with pytest.raises(RuntimeError, match="returned no input gradient"):
            out.backward(dy)
    finally:
        unregister_kernel("test_rebinds")


def test_a_backward_that_returns_a_new_input_gradient_is_copied_into_its_rows(example):
    """Rebound *and* returned: the library writes it where it belongs, and the result is exact."""
    class Returns(example["TanhKernel"]):
        name = "test_returns"

        def backward_into(self, x, dy, grad_in, grads, tensors, shard):
            dz, h = _tanh_grads(x, dy, tensors)
            for index, grad in enumerate((dz.t() @ x, dz.sum(0), dy.t() @ h, dy.sum(0))):
                grads.add(index, grad)
            grad_in = dz @ tensors[0]
            return grad_in

    register_kernel(Returns)
    try:
        module = _seeded_tanh(example)
        x, dy = _tanh_batch()
        want = untiled_run(copy.deepcopy(module), x, dy)
        have = step(TiledMLP(module, num_shards=3, path="test_returns"), x, dy)
        assert_runs_close(want, have, tol=1e-12)
    finally:
        unregister_kernel("test_returns")


@pytest.mark.parametrize("slip, message", [
    (lambda dx, grads: (dx, grads[::2]), "returned 2 gradients for 4 tensors"),  # the weights' only
    # One row: it would broadcast over the shard's rows.
    (lambda dx, grads: (dx.sum(0), grads), r"backward returned rows of shape \(8,\) for rows of shape"),
], ids=["too_few_gradients", "input_gradient_off_its_rows"])
def test_a_backward_whose_gradients_do_not_fit_is_refused_not_broadcast(example, slip, message):
    class Slipping(example["TanhKernel"]):
        name = "test_slipping"

        def backward_shard(self, x, dy, tensors):
            return slip(*super().backward_shard(x, dy, tensors))

    register_kernel(Slipping)
    try:
        tiled = TiledMLP(_seeded_tanh(example), num_shards=3, path="test_slipping")
        x, dy = _tanh_batch()
        with pytest.raises(RuntimeError, match=message):
            tiled(x).backward(dy)
    finally:
        unregister_kernel("test_slipping")


def test_a_kernel_without_a_module_type_declines_with_the_fix():
    class Nameless(ShardKernel):
        name = "test_no_module_type"

    register_kernel(Nameless)
    try:
        tiled = TiledMLP(GatedMLP(8, 20, "silu").double(), num_shards=2)
        tiled(torch.randn(1, 4, 8, dtype=torch.float64))
        assert "'test_no_module_type' declined: Nameless: set module_type" in tiled.tiling.last_reason
    finally:
        unregister_kernel("test_no_module_type")
