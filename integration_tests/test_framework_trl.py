"""TRL's ``SFTTrainer`` end to end with the tiled MLPs, norms and loss, against the same run untiled.

TRL's trainers put a fused LM head on the model's forward (``trl.trainer.utils.add_fused_lm_head``): their
labelled calls compute the loss through it, in tiles, without the logits, and never reach the model's
forward (``tiled_mlp/integrations/trl_seam.py``). Both orders compose: the tiled loss applied before the
trainer is built is wrapped by TRL's head (its calls without ``fused_lm_head`` still reach the tiled loss);
applied after, ``loss=True`` leaves the loss to TRL's head and the report says so. Each run: a tiny Llama in
float64 from its config, three optimizer steps of two micro-batches (gradient accumulation), plain SGD with
a large step; losses and every weight compared with the untiled run."""
from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

from integration_tests.frameworks import need
from integration_tests.tiny_checkpoint import SPECIAL, tokenizer
from integration_tests.tiny_models import VOCAB, tiny_model
from tiled_mlp import apply_tiled_loss, apply_tiled_mlp, remove_tiled_loss
from tiled_mlp.integrations import is_tiled_loss, use_tiled_label_smoothing
from tiled_mlp.strategies import checked_versions

pytestmark = pytest.mark.timeout(60)

VARIANTS = {
    "padded": {},
    "packing": dict(packing=True, max_length=16),  # bfd packing: padding-free batches of several sequences
    "padding_free": dict(padding_free=True, max_length=None),
}


def _dataset(rows=12):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    # Already tokenized, of different lengths (padding, and packing into bins, both have work to do), words
    # only: no special token inside a sample.
    return Dataset.from_list([{"input_ids": torch.randint(len(SPECIAL), VOCAB, (5 + i % 6,), generator=generator).tolist()}
                              for i in range(rows)])


def sft_trainer(model, tmp_path, name, peft_config=None, **config):
    trl = need("trl")
    args = trl.SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=3, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", report_to=[],
                         save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0,
                         logging_steps=1, bf16=False, **config)  # SFTConfig's default bf16 autocast: the generic paths
    return trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=tokenizer(),
                          peft_config=peft_config)


def _train(trainer):
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


def _assert_same_training(want, have):
    want_losses, want_weights = want
    losses, weights = have
    assert len(losses) == 3 and want_losses[0] != want_losses[-1]  # it trained
    assert losses == pytest.approx(want_losses, abs=1e-12)
    assert want_weights.keys() == weights.keys()
    worst = max(float((weights[key] - want_weights[key]).abs().max()) for key in want_weights)
    assert worst < 1e-14, worst


def _tile_all(model):
    return apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiled_loss_applied_before_the_trainer_is_wrapped_by_trls_head(tmp_path, variant):
    config = VARIANTS[variant]
    want = _train(sft_trainer(tiny_model("llama", dtype=torch.float64), tmp_path, "untiled", **config))
    model = tiny_model("llama", dtype=torch.float64)
    report = _tile_all(model)
    assert report.tiled_loss == "LlamaForCausalLM"
    trainer = sft_trainer(model, tmp_path, "tiled", **config)
    _assert_same_training(want, _train(trainer))
    assert is_tiled_loss(model)
    assert {block.tiled.tiling.last_path for block in report.patched} == {"fast", "norm"}


def test_tiled_loss_applied_after_the_trainer_is_left_to_trls_head(tmp_path):
    want = _train(sft_trainer(tiny_model("llama", dtype=torch.float64), tmp_path, "untiled"))
    model = tiny_model("llama", dtype=torch.float64)
    trainer = sft_trainer(model, tmp_path, "tiled")
    report = _tile_all(trainer.model)
    assert report.tiled_loss == "" and not is_tiled_loss(model)
    assert "LlamaForCausalLM: computed by TRL 1.16.0's fused LM head (trl.trainer.utils.add_fused_lm_head)" in str(report)
    assert "the tiled loss is not installed" in report.loss_left_to
    assert apply_tiled_loss(model).loss_left_to == report.loss_left_to  # the loss alone: the same answer
    _assert_same_training(want, _train(trainer))


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_through_sft_trainer_in_either_order(tmp_path, order):
    """``peft_config``: TRL wraps the model in PEFT and puts its head on the base model; the tiled loss is
    found there (applied before) or left to TRL's head (applied after). Every adapter weight compared."""
    need("peft")
    from peft import LoraConfig

    def trainer(model, name):
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "up_proj", "down_proj"])
        return sft_trainer(model, tmp_path, name, peft_config=lora)

    want = _train(trainer(tiny_model("llama", dtype=torch.float64), "untiled"))
    model = tiny_model("llama", dtype=torch.float64)
    if order == "before":
        _tile_all(model)
        built = trainer(model, "tiled")
    else:
        built = trainer(model, "tiled")
        assert "computed by TRL 1.16.0's fused LM head" in _tile_all(built.model).loss_left_to
    _assert_same_training(want, _train(built))


def test_under_trls_head_calls_without_fused_lm_head_reach_the_tiled_loss(tmp_path):
    """TRL's head passes a call without ``fused_lm_head`` to the forward it wraps: the tiled loss (no logits
    returned) with the model's own loss."""
    reference = tiny_model("llama", dtype=torch.float64)
    model = tiny_model("llama", dtype=torch.float64)
    _tile_all(model)
    sft_trainer(model, tmp_path, "tiled")
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = reference(input_ids=ids).logits  # the model's own loss, in float64 (its loss function's is float32)
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    assert abs(float(out.loss - want)) < 1e-12
    fused = model(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's own loss (its kernel's float32 on CPU)
    assert fused.loss.dtype == torch.float32 and abs(float(fused.loss - want)) < 1e-6


def test_removing_the_tiled_loss_under_trls_head_is_refused(tmp_path):
    model = tiny_model("llama", dtype=torch.float64)
    _tile_all(model)
    trainer = sft_trainer(model, tmp_path, "tiled")
    forward = vars(model)["forward"]
    with pytest.raises(RuntimeError, match=r"TRL 1\.16\.0's fused LM head .* wraps the tiled loss"):
        remove_tiled_loss(model)
    assert vars(model)["forward"] is forward and is_tiled_loss(model)
    _train(trainer)  # still trains


def _trl_release(version: str):
    """``checked_versions.installed`` as it would answer with TRL ``version`` installed."""
    real = checked_versions.installed
    return lambda name: version if name == "trl" else real(name)


def test_a_trl_version_not_read_is_refused_in_either_order(tmp_path):
    need("trl")
    model = tiny_model("llama", dtype=torch.float64)
    trainer = sft_trainer(model, tmp_path, "after")
    with mock.patch.object(checked_versions, "installed", _trl_release("1.15.0")):
        with pytest.raises(RuntimeError, match=r"TRL here is 1\.15\.0; .* on trl 1\.16\.0 to 1\.16\.x only"):
            _tile_all(model)
    assert not is_tiled_loss(model) and not any("Tiled" in type(m).__name__ for m in model.modules())

    model = tiny_model("llama", dtype=torch.float64)
    _tile_all(model)
    trainer = sft_trainer(model, tmp_path, "before")
    with mock.patch.object(checked_versions, "installed", _trl_release("1.15.0")):
        with pytest.raises(RuntimeError, match=r"TRL here is 1\.15\.0"):
            trainer.train()


def test_a_forward_replaced_by_trls_head_named_for_what_it_is(tmp_path):
    """A TRL head whose wrapped forward was replaced in between: the message names TRL's function, not the
    class forward whose names ``functools.wraps`` copied onto it."""
    trl_utils = sys.modules[need("trl").trainer.utils.__name__]
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    model.forward = model.forward.__call__  # a bound method of the tiled loss: not the tiled loss itself
    trl_utils.add_fused_lm_head(model)
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match=r"replaced after the tiled loss was installed \(it is "
                                           r"tiled_mlp\.integrations\.causal_lm_loss\.TiledLossForward\.__call__, "
                                           r"inside TRL 1\.16\.0's fused LM head"):
        model(input_ids=ids, labels=ids)


def test_label_smoothing_hand_over_refuses_sft_trainer(tmp_path):
    model = tiny_model("llama", dtype=torch.float64)
    _tile_all(model)
    trainer = sft_trainer(model, tmp_path, "smoothing", label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"trl\.trainer\.sft_trainer\.SFTTrainer computes the loss in a compute_loss "
                                         "of its own"):
        use_tiled_label_smoothing(trainer)
    assert trainer.label_smoother is not None
