"""The tiled loss under accelerate's device hooks (``dispatch_model``, ``add_hook_to_module``): it runs
inside the model's hook (which still moves inputs and outputs around it), whichever was put first; it
is equal in float64 to the untiled model under the same hooks; ``remove_tiled_loss`` leaves the hook
around the model's own forward. A hook on ``lm_head`` that would load offloaded weights is refused."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import dispatch_model  # noqa: E402
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module  # noqa: E402

from integration_tests.comparison import float_kept_float64  # noqa: E402
from integration_tests.tiny_models import VOCAB, tiny_model, token_batch  # noqa: E402
from tiled_mlp import apply_tiled_loss, remove_tiled_loss  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402


def _dispatched(model):
    """What a ``device_map`` over more than one device builds (hooks on the model and on its modules),
    every device CPU."""
    return dispatch_model(model, {"": "cpu"}, force_hooks=True)


def _assert_equal_loss_and_grads(reference, tiled):
    """The untiled model's logits through transformers' ForCausalLMLoss, kept in float64 (it casts the
    logits with ``.float()``: patched around the loss call alone), against the tiled model's loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    ids, labels = token_batch(seed=3)
    logits = reference(input_ids=ids).logits
    with float_kept_float64():
        want = ForCausalLMLoss(logits, labels, VOCAB)
    got = tiled(input_ids=ids, labels=labels)
    assert got.logits is None and got.loss.dtype == want.dtype == torch.float64
    assert abs(got.loss.item() - want.item()) < 1e-12
    want.backward()
    got.loss.backward()
    for (name, p), q in zip(reference.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.timeout(60)
def test_applied_after_dispatch_runs_inside_the_models_hook_equal_to_the_dispatched_untiled_model():
    reference = _dispatched(tiny_model("llama"))
    tiled = _dispatched(tiny_model("llama"))
    wrapper = vars(tiled)["forward"]
    apply_tiled_loss(tiled, num_shards=3)
    assert is_tiled_loss(tiled)
    assert vars(tiled)["forward"] is wrapper  # the hook stays outermost; the tiled loss is what it wraps
    assert vars(tiled)["_old_forward"] is not vars(reference)["_old_forward"]
    moved = []
    pre_forward = tiled._hf_hook.pre_forward
    tiled._hf_hook.pre_forward = lambda module, *a, **k: moved.append(1) or pre_forward(module, *a, **k)
    _assert_equal_loss_and_grads(reference, tiled)
    assert moved == [1]  # the hook ran around the tiled loss, once


@pytest.mark.timeout(60)
def test_remove_after_dispatch_leaves_the_hook_around_the_models_own_forward():
    model = _dispatched(tiny_model("llama"))
    wrapper, hook = vars(model)["forward"], model._hf_hook
    apply_tiled_loss(model, num_shards=3)
    assert remove_tiled_loss(model) and not is_tiled_loss(model)
    assert not model._forward_pre_hooks
    assert vars(model)["forward"] is wrapper and model._hf_hook is hook
    old = vars(model)["_old_forward"]
    assert old.__self__ is model and old.__func__ is type(model).forward
    ids, labels = token_batch(seed=3)
    assert model(input_ids=ids, labels=labels).logits is not None
    remove_hook_from_module(model, recurse=True)  # accelerate's own removal then leaves the class forward
    assert vars(model)["forward"].__func__ is type(model).forward


@pytest.mark.timeout(60)
def test_hook_added_over_the_tiled_loss_is_seen_and_removed_around_the_models_own_forward():
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    apply_tiled_loss(tiled, num_shards=3)
    reference, tiled = _dispatched(reference), _dispatched(tiled)
    assert is_tiled_loss(tiled)
    _assert_equal_loss_and_grads(reference, tiled)
    assert remove_tiled_loss(model=tiled) and not is_tiled_loss(tiled)
    wrapper = vars(tiled)["forward"]
    old = vars(tiled)["_old_forward"]
    assert old.__self__ is tiled and old.__func__ is type(tiled).forward
    assert wrapper.__wrapped__ is old and wrapper.args == (tiled,)  # as add_hook_to_module builds it
    assert not {"model", "previous", "form"} & set(vars(wrapper))  # nothing of the tiled loss copied on


@pytest.mark.timeout(60)
def test_head_hook_that_loads_offloaded_weights_is_refused_at_apply():
    model = tiny_model("llama")
    add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu", offload=True))
    with pytest.raises(TypeError, match=r"accelerate's device hook .*offload=True.*Give lm_head the device"):
        apply_tiled_loss(model)
    assert not is_tiled_loss(model)


@pytest.mark.timeout(60)
def test_head_hook_moving_the_hidden_states_elsewhere_is_refused_at_the_call():
    model = tiny_model("llama")
    apply_tiled_loss(model, num_shards=3)
    add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="meta"))
    ids, labels = token_batch(seed=3)
    with pytest.raises(RuntimeError, match=r"would move the hidden states to meta; they are on cpu"):
        model(input_ids=ids, labels=labels)
