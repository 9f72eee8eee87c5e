"""The tiled loss under accelerate's mixed precision: ``Accelerator.prepare`` wraps the model's forward
(``convert_outputs_to_fp32(autocast(forward))``, the tiled forward inside); the tiled loss is still seen
there, runs inside the autocast as the model's own loss does, and ``remove_tiled_loss`` leaves what
``prepare`` would have built around the model's own forward. Installing it after ``prepare`` is refused."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_tests.tiny_models import tiny_model, token_batch  # noqa: E402
from tiled_mlp import apply_tiled_loss, remove_tiled_loss  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402

# bf16 autocast: the loss agrees to float32 rounding, the gradients to bf16 rounding (measured 5e-7, 4e-4).
LOSS_ATOL, GRAD_ATOL = 1e-5, 2e-3


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # A process-wide singleton: another test in this process (a Trainer's TrainingArguments) may have made one
    # with other settings, which Accelerator() refuses to change; reset before and after.
    AcceleratorState._reset_state(reset_partial_state=True)
    yield Accelerator(mixed_precision="bf16", cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.timeout(60)
def test_seen_through_the_mixed_precision_wrapper_and_equal_to_the_prepared_untiled_model(accelerator):
    reference = tiny_model("llama", dtype=torch.float32)
    tiled = copy.deepcopy(reference)
    apply_tiled_loss(tiled, num_shards=3)
    reference, tiled = accelerator.prepare(reference), accelerator.prepare(tiled)
    assert "__wrapped__" in dir(vars(tiled)["forward"])  # prepare did wrap the forward
    assert is_tiled_loss(tiled)
    ids, labels = token_batch()
    want, got = reference(input_ids=ids, labels=labels), tiled(input_ids=ids, labels=labels)
    assert got.logits is None and got.loss.dtype == torch.float32
    assert abs(got.loss.item() - want.loss.item()) < LOSS_ATOL
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=GRAD_ATOL, msg=name)


@pytest.mark.timeout(60)
def test_remove_leaves_what_prepare_builds_around_the_models_own_forward(accelerator):
    reference = accelerator.prepare(tiny_model("llama", dtype=torch.float32))
    model = tiny_model("llama", dtype=torch.float32)
    apply_tiled_loss(model, num_shards=3)
    model = accelerator.prepare(model)
    assert remove_tiled_loss(model) and not is_tiled_loss(model)
    assert not model._forward_pre_hooks
    original = model._original_forward
    assert original.__self__ is model and original.__func__ is type(model).forward  # as prepare keeps it
    ids, labels = token_batch()
    want, got = reference(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.logits is not None and got.loss.item() == want.loss.item()  # the same computation, bit for bit
    assert remove_tiled_loss(model) is False
    # accelerate's own unwrap walks the same chain as on the model never tiled
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert vars(unwrapped)["forward"].__func__ is \
        vars(accelerator.unwrap_model(reference, keep_fp32_wrapper=False))["forward"].__func__


@pytest.mark.timeout(60)
def test_unwrap_without_the_fp32_wrapper_keeps_the_tiled_loss_and_remove_takes_it_off(accelerator):
    """``unwrap_model(keep_fp32_wrapper=False)`` binds the forward it finds (the tiled one) to the model."""
    reference = tiny_model("llama", dtype=torch.float32)
    model = copy.deepcopy(reference)
    apply_tiled_loss(model, num_shards=3)
    model = accelerator.unwrap_model(accelerator.prepare(model), keep_fp32_wrapper=False)
    assert is_tiled_loss(model)
    ids, labels = token_batch()
    got = model(input_ids=ids, labels=labels)
    assert got.logits is None and abs(got.loss.item() - reference(input_ids=ids, labels=labels).loss.item()) < 1e-6
    assert remove_tiled_loss(model) and "forward" not in vars(model)


@pytest.mark.timeout(60)
def test_install_after_prepare_is_refused_with_the_order_that_works(accelerator):
    model = accelerator.prepare(tiny_model("llama", dtype=torch.float32))
    with pytest.raises(TypeError, match=r"Apply the tiled loss before accelerator.prepare\(model\)"):
        apply_tiled_loss(model)
    assert not is_tiled_loss(model)
