"""The tiled loss never silently replaces or drops what the user set on a Hugging Face causal LM: a loss
function of its own (on the instance, its class, or by ``loss_type``) or a forward of its own is refused,
at install or at the first call after it was set, before any work; ``return_dict=False`` keeps
transformers' tuple positions. Decided by what the loss function and the forward are (identity), in
float64 against an untiled copy."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model, token_batch  # noqa: E402
from tiled_mlp import apply_tiled_loss, apply_tiled_mlp, remove_tiled_loss  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402


def _own_loss(*_args, **_kwargs):
    return torch.tensor(999.99, dtype=torch.float64)


def _decoder_calls(model):
    """How many times the decoder ran: a refusal 'before any work' leaves it at 0."""
    calls = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.timeout(60)
def test_a_class_level_loss_function_property_is_refused_at_install():
    from transformers import LlamaForCausalLM

    class OwnLoss(LlamaForCausalLM):
        @property
        def loss_function(self):
            return _own_loss

    model = OwnLoss(tiny_model("llama").config).double()
    ids, labels = token_batch()
    assert model(input_ids=ids, labels=labels).loss.item() == pytest.approx(999.99)
    with pytest.raises(TypeError, match="OwnLoss defines its own loss_function"):
        apply_tiled_loss(model)
    with pytest.raises(TypeError, match="own loss_function"):
        apply_tiled_mlp(model, loss=True)
    assert not is_tiled_loss(model) and "forward" not in vars(model)


@pytest.mark.timeout(60)
def test_a_loss_function_set_after_install_is_refused_at_the_call_before_any_work():
    model = tiny_model("llama")
    apply_tiled_loss(model, num_shards=2)
    model.loss_function = _own_loss
    calls = _decoder_calls(model)
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match="loss function changed after the tiled loss was installed"):
        model(input_ids=ids, labels=labels)
    assert calls == []
    del model._loss_function  # transformers' default again: the tiled loss runs
    assert model(input_ids=ids, labels=labels).loss.requires_grad


@pytest.mark.timeout(60)
def test_a_loss_type_other_than_causal_lm_is_refused_at_install_and_at_the_call():
    masked = tiny_model("llama")
    masked.loss_type = "ForMaskedLM"  # transformers' loss_function resolves LOSS_MAPPING[loss_type]: no shift
    with pytest.raises(TypeError, match="loss_type is 'ForMaskedLM'"):
        apply_tiled_loss(masked)

    model = tiny_model("llama")
    apply_tiled_loss(model)
    model.loss_type = "ForMaskedLM"
    calls = _decoder_calls(model)
    with pytest.raises(RuntimeError, match="ForMaskedLM"):
        model(input_ids=token_batch()[0], labels=token_batch()[1])
    assert calls == []


@pytest.mark.timeout(60)
def test_config_loss_type_is_not_read_by_transformers_and_the_loss_stays_exact():
    """transformers sets ``model.loss_type`` from the class name at construction and never reads the config's:
    with ``config.loss_type`` set, the model's own loss is still ForCausalLMLoss, and so is the tiled one."""
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    for model in (reference, tiled):
        model.config.loss_type = "ForMaskedLM"
    apply_tiled_loss(tiled, num_shards=3)
    ids, labels = token_batch()
    want = reference(input_ids=ids, labels=labels).loss  # ForCausalLMLoss in float32 (its .float())
    got = tiled(input_ids=ids, labels=labels).loss
    assert abs(got.item() - want.item()) < 1e-6


def _doubling(forward, wraps):
    def doubled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.loss = out.loss * 2
        return out

    return functools.wraps(forward)(doubled) if wraps else doubled


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wraps", [True, False], ids=["functools_wraps", "bare"])
def test_a_forward_of_its_own_on_the_instance_is_refused_at_install(wraps):
    """With ``functools.wraps`` the tiled loss would drop what the wrapper does to the loss; without, the
    wrapper hides ``labels`` from the signature and the tiled loss would never run."""
    model = tiny_model("llama")
    model.forward = _doubling(model.forward, wraps)
    # Named by where it was defined: functools.wraps gave it the class forward's names.
    named = (r"\((tests\.)?test_hf_loss_user_overrides\._doubling\.<locals>\.doubled"
             + (r", which carries the name transformers\.models\.llama\.modeling_llama\.LlamaForCausalLM\.forward "
                r"\(functools\.wraps\)\)" if wraps else r"\)"))
    with pytest.raises(TypeError, match=named):
        apply_tiled_loss(model)
    with pytest.raises(TypeError, match="a forward of its own"):
        apply_tiled_mlp(model, loss=True)
    assert not is_tiled_loss(model)


@pytest.mark.timeout(60)
def test_the_class_forward_bound_on_the_instance_is_accepted_and_put_back():
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    bound = model.forward
    model.forward = bound  # the class's own forward, bound to this model: nothing of its own
    apply_tiled_loss(model, num_shards=3)
    ids, labels = token_batch()
    got = model(input_ids=ids, labels=labels).loss
    assert abs(got.item() - reference(input_ids=ids, labels=labels).loss.item()) < 1e-6
    assert remove_tiled_loss(model) and vars(model)["forward"] is bound


@pytest.mark.timeout(60)
@pytest.mark.parametrize("calls_ours", [True, False], ids=["wraps_the_tiled_forward", "bypasses_it"])
def test_a_forward_set_after_install_is_refused_at_the_next_call(calls_ours):
    model = tiny_model("llama")
    apply_tiled_loss(model)
    inner = model.forward if calls_ours else type(model).forward.__get__(model)
    model.forward = _doubling(inner, wraps=True)
    calls = _decoder_calls(model)
    ids, labels = token_batch()
    with pytest.raises(RuntimeError, match=r"forward was replaced after the tiled loss was installed \(it is "
                                           r"(tests\.)?test_hf_loss_user_overrides\._doubling\.<locals>\.doubled, which carries "
                                           r"the name .*\(functools\.wraps\)\)"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(RuntimeError, match="forward was replaced"):
        model(input_ids=ids)
    if calls_ours:  # called as a method, past the module's hooks: the tiled forward itself refuses
        with pytest.raises(RuntimeError, match="forward was replaced"):
            model.forward(input_ids=ids, labels=labels)
    assert calls == []
    assert is_tiled_loss(model)  # still installed; removing it would not undo the new forward
    with pytest.raises(RuntimeError, match="remove the tiled loss first"):
        remove_tiled_loss(model)


@pytest.mark.timeout(60)
def test_return_dict_false_keeps_transformers_tuple_positions():
    """transformers returns ``(loss, logits, past_key_values)``; the tiled loss holds no logits, so ``None``
    stands at index 1 and every other entry keeps its index."""
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    apply_tiled_loss(tiled, num_shards=3)
    ids, labels = token_batch()
    kwargs = {"use_cache": True, "return_dict": False}
    want = reference(input_ids=ids, labels=labels, **kwargs)
    got = tiled(input_ids=ids, labels=labels, **kwargs)
    assert isinstance(got, tuple) and len(got) == len(want) == 3
    assert abs(got[0].item() - want[0].item()) < 1e-6
    assert want[1].shape[-1] == VOCAB and got[1] is None
    assert type(got[2]) is type(want[2])
    for layer_want, layer_got in zip(want[2].layers, got[2].layers, strict=True):
        torch.testing.assert_close(layer_got.keys, layer_want.keys, rtol=0, atol=1e-12)
    assert isinstance(tiled(input_ids=ids, labels=labels, return_dict=True), dict)
