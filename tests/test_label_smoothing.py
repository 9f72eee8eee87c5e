"""Label smoothing in the tiled loss, against transformers' own ``LabelSmoother``: the kernel alone (loss,
hidden-state and head gradients, ignored labels, a scaled incoming gradient, the Trainer's
``num_items_in_batch``), and the real ``Trainer`` with ``label_smoothing_factor`` handed to the tiled loss
(``use_tiled_label_smoothing``) against the same run untiled, where the Trainer's smoother computes from the
logits. Also what a user who does not hand it over sees (a warning at the first training call without
labels), and the refusals."""
from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from loss_reference import (
    assert_same_run,
    hf_label_smoother,
    hidden_batch,
    linear_head,
    loss_run,
    module_head,
    single_thread,
)

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, TokenRows, tiny_model  # noqa: E402
from tiled_mlp import apply_tiled_loss, apply_tiled_mlp  # noqa: E402
from tiled_mlp.core import tiled_cross_entropy  # noqa: E402
from tiled_mlp.integrations import set_tiled_loss_label_smoothing, use_tiled_label_smoothing  # noqa: E402
from tiled_mlp.integrations.causal_lm_loss import tiled_loss_forward  # noqa: E402
from tiled_mlp.strategies import checked_versions  # noqa: E402

pytestmark = pytest.mark.timeout(60)
one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)

HEADS = {"linear-bias": lambda: linear_head(bias=True), "module": lambda: module_head()}


# -- the kernel against LabelSmoother, in float64 ----------------------------------------------------------
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("num_items", [None, 23])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_tiled_label_smoothing_equals_label_smoother(head, num_items, ignore_index):
    """Loss, dx and every head gradient, with ignored labels and a loss scaled by 2.5 before backward."""
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(shape=(2, 11), seed=5)
    labels[labels == -100] = ignore_index
    labels[1, 3:6] = ignore_index
    eps = 0.15

    def reference(x, m):
        return hf_label_smoother(m(x), labels, eps, ignore_index=ignore_index, num_items_in_batch=num_items)

    def tiled(x, m):
        return tiled_cross_entropy(x, m, labels, label_smoothing=eps, ignore_index=ignore_index,
                                   num_items_in_batch=num_items, num_shards=3)

    want = loss_run(reference, hidden, lm_head, grad_scale=2.5)
    assert want.loss.dtype == torch.float64
    assert_same_run(want, loss_run(tiled, hidden, lm_head, grad_scale=2.5), atol=1e-13)


def test_label_smoother_itself_sums_its_smoothing_in_float32():
    """The unpatched LabelSmoother differs from the tiled loss in float64 only at float32's rounding of its
    smoothing term: the bound the Trainer comparison below states."""
    lm_head = linear_head(bias=True)
    hidden, labels = hidden_batch(shape=(2, 11), seed=6)
    logits = lm_head(hidden)
    exact = hf_label_smoother(logits, labels, 0.1)
    as_is = hf_label_smoother(logits, labels, 0.1, downcast=True)
    tiled = tiled_cross_entropy(hidden, lm_head, labels, label_smoothing=0.1, num_shards=2)
    assert abs(float((exact - tiled).detach())) < 1e-14
    assert 0 < abs(float((as_is - tiled).detach())) < 1e-6


# -- the real Trainer ----------------------------------------------------------------------------------------


def _prompted_rows(n=8, seq=11, seed=3) -> TokenRows:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100  # prompts: rows and micro-batches with different numbers of valid tokens
    labels[1::2, 5:8] = -100
    return TokenRows(ids, labels)


class _Float64Smoother:
    """The Trainer's own LabelSmoother, run with its float32 sum kept in float64 (``hf_label_smoother``)."""

    def __init__(self, smoother):
        self.smoother = smoother

    def __call__(self, *args, **kwargs):
        with mock.patch.object(torch, "float32", torch.float64):
            return self.smoother(*args, **kwargs)


def _trainer(model, tmp_path, name, factor=0.1, **extra):
    from transformers import Trainer, TrainingArguments

    # Plain SGD with a large step: a wrong gradient shows in the weights. Two micro-batches per step: the
    # Trainer's num_items_in_batch counts the valid tokens of both.
    args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, logging_steps=1,
                             label_smoothing_factor=factor, **extra)
    return Trainer(model=model, args=args, train_dataset=_prompted_rows(), eval_dataset=_prompted_rows(4, seed=4))


def _train_and_evaluate(trainer):
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, trainer.evaluate()["eval_loss"], {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _max_diff(want, have):
    return max(float((have[key] - want[key]).abs().max()) for key in want)


@pytest.mark.timeout(90)
def test_trainer_label_smoothing_in_the_tiled_loss_equals_untiled(tmp_path):
    """Untiled: the Trainer's LabelSmoother on the model's logits (its float32 sum kept in float64, and as it
    is). Tiled (MLPs, norms, loss): the smoothing handed to the tiled loss. Losses, evaluation loss and
    every weight after three steps of two micro-batches."""
    reference = _trainer(tiny_model("llama", dtype=torch.float64), tmp_path, "untiled")
    reference.label_smoother = _Float64Smoother(reference.label_smoother)
    want_losses, want_eval, want = _train_and_evaluate(reference)
    as_is_losses, as_is_eval, as_is = _train_and_evaluate(_trainer(tiny_model("llama", dtype=torch.float64), tmp_path, "as-is"))

    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_mlp(model, num_shards=2, loss=True, norms=True, loss_num_shards=3)
    trainer = _trainer(model, tmp_path, "tiled")
    assert use_tiled_label_smoothing(trainer) == 0.1
    assert trainer.label_smoother is None and tiled_loss_forward(model).label_smoothing == 0.1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tiled loss")  # every training call carries labels now
        losses, eval_loss, have = _train_and_evaluate(trainer)

    assert want_losses[0] != want_losses[-1]  # it trained
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=0, atol=1e-12)
    assert abs(eval_loss - want_eval) < 1e-12
    assert _max_diff(want, have) < 1e-13
    # HF's smoother as it is: float32's rounding of its smoothing term, no more.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(as_is_losses), rtol=1e-6, atol=0)
    assert abs(eval_loss - as_is_eval) < 1e-7
    assert _max_diff(as_is, have) < 1e-7


@pytest.mark.timeout(60)
def test_trainer_label_smoothing_not_handed_over_warns(tmp_path):
    """Without the hand-over the Trainer takes the labels out and smooths from the whole logits: the tiled
    loss cannot run, and says so at the first training call (once)."""
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    trainer = _trainer(model, tmp_path, "plain")
    with pytest.warns(UserWarning, match="called in training without labels") as caught:
        trainer.train()
    assert sum("without labels" in str(w.message) for w in caught) == 1


def test_training_call_without_labels_warns_once_and_evaluation_does_not():
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.eval()
        model(input_ids=ids)  # evaluation mode
        model.train()
        with torch.no_grad():
            model(input_ids=ids)  # no graph
        model(input_ids=ids, labels=ids)  # labels: the tiled loss runs
    with pytest.warns(UserWarning, match="use_tiled_label_smoothing"):
        assert model(input_ids=ids).logits.shape == (1, 7, VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids)  # said once


def test_evaluation_with_smoothing_returns_logits_and_the_smoothed_loss():
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    set_tiled_loss_label_smoothing(model, 0.2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert abs(float(out.loss - hf_label_smoother(out.logits, labels, 0.2))) < 1e-13
    assert torch.equal(as_tuple[0], out.loss) and torch.equal(as_tuple[1], out.logits)


# -- refusals, before anything changes ---------------------------------------------------------------------
def _refused(trainer, match):
    before = trainer.label_smoother
    with pytest.raises(ValueError, match=match):
        use_tiled_label_smoothing(trainer)
    assert trainer.label_smoother is before
    installed = tiled_loss_forward(trainer.model)
    assert installed is None or installed.label_smoothing == 0.0


def test_refusals(tmp_path):
    from transformers import Trainer

    untiled = _trainer(tiny_model("llama", dtype=torch.float64), tmp_path, "a")
    _refused(untiled, "no tiled loss on the trainer's model")

    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    trainer = _trainer(model, tmp_path, "b")
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    _refused(trainer, "compute_loss_func")

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    own = OwnLoss(model=model, args=trainer.args, train_dataset=_prompted_rows())
    _refused(own, "OwnLoss computes the loss in a compute_loss of its own")

    trainer = _trainer(model, tmp_path, "c")
    trainer.model_accepts_loss_kwargs = False
    _refused(trainer, "num_items_in_batch")

    real = checked_versions.installed
    with mock.patch.object(checked_versions, "installed", lambda name: "5.0.0" if name == "transformers" else real(name)):
        _refused(_trainer(model, tmp_path, "d"), "transformers here is 5.0.0")

    moe = tiny_model("mixtral", dtype=torch.float64)
    apply_tiled_loss(moe)
    _refused(_trainer(moe, tmp_path, "e"), "router's auxiliary loss")

    # The Trainer smooths the labels of a model whose class is not a causal LM of transformers' mapping unshifted
    # (here: the same model, its name read as another); the tiled loss shifts them.
    with mock.patch.object(type(model), "_get_name", lambda self: "SomeoneElsesLM"):
        _refused(_trainer(model, tmp_path, "f"), "smooths SomeoneElsesLM's labels unshifted")


def test_no_smoother_is_left_as_it_is(tmp_path):
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    trainer = _trainer(model, tmp_path, "none", factor=0.0)
    assert use_tiled_label_smoothing(trainer) == 0.0
    trainer = _trainer(model, tmp_path, "twice", factor=0.3)
    assert use_tiled_label_smoothing(trainer) == use_tiled_label_smoothing(trainer) == 0.3


@pytest.mark.parametrize("factor, error", [(1.5, ValueError), (-0.1, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_set_label_smoothing_refuses_bad_factors(factor, error):
    model = tiny_model("llama", dtype=torch.float64)
    apply_tiled_loss(model)
    with pytest.raises(error):
        set_tiled_loss_label_smoothing(model, factor)
    assert tiled_loss_forward(model).label_smoothing == 0.0
    with pytest.raises(ValueError, match="no tiled loss"):
        set_tiled_loss_label_smoothing(tiny_model("llama"), 0.1)


@pytest.mark.timeout(120)
def test_compiled_model_smooths_labels_as_the_eager_one():
    """Under torch.compile the tiled loss is one op, which takes the smoothing as the eager loss does."""
    torch._dynamo.reset()
    config = tiny_model("llama").config
    config.num_hidden_layers = 1  # the compile time is per graph
    torch.manual_seed(0)
    reference = type(tiny_model("llama"))(config).float()
    tiled = apply_tiled_loss(reference) and reference
    set_tiled_loss_label_smoothing(tiled, 0.1)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    got = torch.compile(tiled, backend="aot_eager")(input_ids=ids, labels=labels).loss
    torch._dynamo.reset()
    with torch.no_grad():  # evaluation with smoothing keeps the logits: LabelSmoother on them
        logits = tiled(input_ids=ids, labels=labels).logits
    want = hf_label_smoother(logits, labels, 0.1)
    assert abs(got.item() - want.item()) <= 1e-6
