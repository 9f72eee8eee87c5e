"""The tiled loss on Hugging Face causal LMs (``apply_tiled_loss`` / ``apply_tiled_mlp(loss=True)``):
every covered family's loss and every gradient equal to the model's own loss path in float64, with the
Trainer's ``num_items_in_batch``, pre-shifted labels, gradient checkpointing, PEFT, and the drop-in rules
(names, reversal, refusals)."""
from __future__ import annotations

import copy
import pickle
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.comparison import float_kept_float64  # noqa: E402
from integration_tests.tiny_models import FAMILIES, VOCAB, TokenRows, grads_by_key, tiny_model, token_batch  # noqa: E402
from tiled_mlp import TiledMLP, apply_tiled_loss, apply_tiled_mlp, remove_tiled_loss, remove_tiled_mlp  # noqa: E402
from tiled_mlp.integrations import is_tiled_loss  # noqa: E402

SHARDS = 3
MOE = ("qwen3_moe", "mixtral")


def _reference_loss(model, ids, labels, **loss_kwargs):
    """The model's own loss path in float64: its logits (soft-capped by its forward where the family does),
    then Hugging Face's ForCausalLMLoss, which casts logits to float32 (``.float()``): patched to keep
    float64 for the comparison only, around the loss call alone. The MoE families add the router's loss."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    moe = {"output_router_logits": True} if hasattr(model.config, "router_aux_loss_coef") else {}
    out = model(input_ids=ids, **moe)
    with float_kept_float64():
        loss = ForCausalLMLoss(out.logits, labels, VOCAB, **loss_kwargs)
    if moe:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    return loss


def _assert_same_grads(reference, tiled):
    want, got = grads_by_key(reference), grads_by_key(tiled)
    assert want.keys() == got.keys()  # no name changed
    for key, g in want.items():
        assert (g is None) == (got[key] is None), key
        if g is not None:
            torch.testing.assert_close(got[key], g, rtol=0, atol=1e-12, msg=key)
    assert want["lm_head.weight"] is not None and want["lm_head.weight"].abs().max() > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loss_and_every_grad_equal_to_its_own_loss_path(family):
    reference = tiny_model(family)
    tiled = copy.deepcopy(reference)
    apply_tiled_loss(tiled, num_shards=SHARDS)
    ids, labels = token_batch(seq=13, masked=4)
    ref_loss = _reference_loss(reference, ids, labels)
    ref_loss.backward()
    moe = {"output_router_logits": True} if family in MOE else {}
    out = tiled(input_ids=ids, labels=labels, **moe)
    out.loss.backward()
    assert abs(out.loss.item() - ref_loss.item()) <= 1e-12
    assert out.logits is None  # with labels, no logits: they were never held
    _assert_same_grads(reference, tiled)


@pytest.mark.timeout(60)
def test_gemma2_soft_capping_is_applied():
    """Gemma 2's config soft-caps the logits; without the cap the loss would differ (the test means something)."""
    model = tiny_model("gemma2")
    model.config.final_logit_softcapping = 0.05  # tight enough to move the tiny model's small logits
    ids, labels = token_batch(seq=13, masked=4)
    want = _reference_loss(model, ids, labels)
    apply_tiled_loss(model, num_shards=SHARDS)
    assert abs(model(input_ids=ids, labels=labels).loss.item() - want.item()) <= 1e-12
    model.config.final_logit_softcapping = None
    assert abs(model(input_ids=ids, labels=labels).loss.item() - want.item()) > 1e-3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_num_items_in_batch_and_incoming_gradient_scale(scale):
    """The Trainer's path: sum / num_items_in_batch (a count over all micro-batches), times a factor."""
    reference, tiled = tiny_model("llama"), tiny_model("llama")
    apply_tiled_loss(tiled, num_shards=SHARDS)
    ids, labels = token_batch(seq=13, masked=4)
    n = torch.tensor(37)
    (_reference_loss(reference, ids, labels, num_items_in_batch=n) * scale).backward()
    (tiled(input_ids=ids, labels=labels, num_items_in_batch=n).loss * scale).backward()
    _assert_same_grads(reference, tiled)


@pytest.mark.timeout(60)
def test_shift_labels_given_pre_shifted_equal_labels():
    model = tiny_model("qwen2")
    apply_tiled_loss(model, num_shards=SHARDS)
    ids, labels = token_batch(seq=13, masked=4)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    a = model(input_ids=ids, labels=labels).loss
    b = model(input_ids=ids, shift_labels=shifted).loss
    assert a.item() == b.item()


@pytest.mark.timeout(60)
def test_without_labels_the_model_is_unchanged_and_return_dict_false():
    reference, tiled = tiny_model("llama"), tiny_model("llama")
    apply_tiled_loss(tiled)
    ids, labels = token_batch(seq=13, masked=4)
    assert torch.equal(tiled(input_ids=ids).logits, reference(input_ids=ids).logits)
    as_tuple = tiled(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.is_tensor(as_tuple[0]) and as_tuple[0].dim() == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_tiled_mlp_and_loss(reentrant):
    reference, tiled = tiny_model("llama"), tiny_model("llama")
    for model in (reference, tiled):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    report = apply_tiled_mlp(tiled, num_shards=SHARDS, loss=True)
    assert report.tiled_loss == "LlamaForCausalLM" and "loss" in str(report)
    ids, labels = token_batch(seq=13, masked=4)
    _reference_loss(reference, ids, labels).backward()
    tiled(input_ids=ids, labels=labels).loss.backward()
    _assert_same_grads(reference, tiled)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["lora_lm_head", "modules_to_save"])
def test_peft_lm_head_adapters_and_saved_head(target, tmp_path):
    """LoRA on lm_head takes the generic head kernel (the head is PEFT's lora.Linear); ``modules_to_save``
    trains a copy of the head behind a wrapper. Gradients equal, adapter keys unchanged and saved."""
    peft = pytest.importorskip("peft")
    kwargs = ({"target_modules": ["lm_head", "q_proj"]} if target == "lora_lm_head"
              else {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kwargs)
    reference = peft.get_peft_model(tiny_model("llama"), copy.deepcopy(config))
    tiled = copy.deepcopy(reference)
    apply_tiled_loss(tiled, num_shards=SHARDS)
    assert is_tiled_loss(tiled)
    ids, labels = token_batch(seq=13, masked=4)
    (_reference_loss(reference, ids, labels)).backward()
    out = tiled(input_ids=ids, labels=labels)
    out.loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in tiled.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and any("lm_head" in n for n in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-12, msg=name)
    tiled.save_pretrained(tmp_path)
    reference.save_pretrained(tmp_path / "ref")
    from safetensors.torch import load_file
    assert load_file(tmp_path / "adapter_model.safetensors").keys() == \
        load_file(tmp_path / "ref" / "adapter_model.safetensors").keys()


def _uneven_rows() -> TokenRows:
    ids = [token_batch(seed=i, batch=1, seq=11 + i % 3, masked=4)[0][0] for i in range(8)]
    labels = [row.clone() for row in ids]
    for i, row in enumerate(labels):
        row[: i % 4] = -100  # a different number of valid tokens per sample
    return TokenRows(ids, labels)


def _collate(rows):
    width = max(len(r["input_ids"]) for r in rows)
    pad = lambda t, v: torch.nn.functional.pad(t, (0, width - len(t)), value=v)  # noqa: E731
    return {"input_ids": torch.stack([pad(r["input_ids"], 0) for r in rows]),
            "labels": torch.stack([pad(r["labels"], -100) for r in rows])}


@pytest.mark.timeout(120)
def test_trainer_gradient_accumulation_with_num_items_in_batch(tmp_path):
    """The Trainer counts valid tokens over the accumulated micro-batches (``num_items_in_batch``) and
    passes it to the model: the losses and weights after 3 steps equal the untiled run's."""
    from transformers import Trainer, TrainingArguments

    def run(tiled: bool):
        model = tiny_model("llama", dtype=torch.float32)
        if tiled:
            apply_tiled_mlp(model, num_shards=SHARDS, loss=True)
        args = TrainingArguments(output_dir=str(tmp_path / str(tiled)), per_device_train_batch_size=1,
                                 gradient_accumulation_steps=2, max_steps=3, logging_steps=1, learning_rate=2.0,
                                 optim="sgd", report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                                 dataloader_num_workers=0, lr_scheduler_type="constant")
        trainer = Trainer(model=model, args=args, train_dataset=_uneven_rows(), data_collator=_collate)
        assert trainer.model_accepts_loss_kwargs  # the signature is the model's own: num_items_in_batch is passed
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], model

    want, reference = run(False)
    got, tiled = run(True)
    assert len(want) == 3 and want[0] != want[-1]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled.lm_head.weight, reference.lm_head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_reversible_names_unchanged_copy_and_pickle():
    model = tiny_model("mistral")
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    apply_tiled_mlp(model, num_shards=SHARDS, loss=True)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    ids, labels = token_batch(seq=13, masked=4)
    loss = model(input_ids=ids, labels=labels).loss
    assert copy.deepcopy(model)(input_ids=ids, labels=labels).loss.item() == loss.item()
    assert pickle.loads(pickle.dumps(model))(input_ids=ids, labels=labels).loss.item() == loss.item()
    remove_tiled_mlp(model)
    assert "forward" not in vars(model) and not is_tiled_loss(model)
    assert not any(isinstance(m, TiledMLP) for m in model.modules())
    assert model(input_ids=ids, labels=labels).logits is not None
    assert remove_tiled_loss(model) is False


@pytest.mark.timeout(60)
def test_refusals_leave_the_model_untouched():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB))
    with pytest.raises(TypeError, match="not one of the causal LMs"):
        apply_tiled_mlp(gpt2, loss=True)
    assert not any(isinstance(m, TiledMLP) for m in gpt2.modules())  # refused before any block was tiled

    custom = tiny_model("llama")
    custom.loss_function = lambda *a, **k: torch.zeros(())
    with pytest.raises(TypeError, match="its own loss_function"):
        apply_tiled_loss(custom)

    patched = tiny_model("llama")
    with mock.patch.object(type(patched), "forward", lambda self, *a, **k: None):
        with pytest.raises(TypeError, match="another library patched"):
            apply_tiled_loss(patched)
    assert "forward" not in vars(patched)

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        apply_tiled_mlp(model, loss=True, loss_num_shards=0)  # at apply, not at the first training call
    assert "forward" not in vars(model) and not any(isinstance(m, TiledMLP) for m in model.modules())
    apply_tiled_loss(model)
    ids, labels = token_batch(seq=13, masked=4)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)


@pytest.mark.timeout(60)
def test_evaluation_without_a_graph_returns_the_models_own_output_with_logits():
    """Trainer.evaluate with metrics reads the logits; without a graph nothing is held for a backward."""
    reference, tiled = tiny_model("llama"), tiny_model("llama")
    apply_tiled_loss(tiled, num_shards=SHARDS)
    ids, labels = token_batch(seq=13, masked=4)
    with torch.no_grad():
        want, got = reference(input_ids=ids, labels=labels), tiled(input_ids=ids, labels=labels)
    assert got.logits is not None and torch.equal(got.logits, want.logits) and got.loss.item() == want.loss.item()


@pytest.mark.timeout(60)
def test_labels_and_shift_labels_together_use_shift_labels():
    """The Trainer passes both under context and DeepSpeed sequence parallelism, as ForCausalLMLoss takes them."""
    model = tiny_model("llama")
    apply_tiled_loss(model, num_shards=SHARDS)
    ids, labels = token_batch(seq=13, masked=4)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    both = model(input_ids=ids, labels=labels, shift_labels=shifted).loss
    assert both.item() == model(input_ids=ids, shift_labels=shifted).loss.item()
    assert both.item() == model(input_ids=ids, labels=labels).loss.item()
