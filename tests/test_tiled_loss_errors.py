"""What the tiled loss refuses: each a clear error raised before any work (no matmul ran, no ``.grad``
changed), and the two backwards it cannot serve (double backward, a second backward through one call),
refused without consuming the gradients the first plain backward still delivers."""
from __future__ import annotations

import pytest
import torch
from loss_reference import (
    HIDDEN,
    VOCAB,
    OpLog,
    ScaledLoRAHead,
    assert_same_run,
    hf_loss,
    hidden_batch,
    linear_head,
    loss_run,
    max_abs_diff,
    module_head,
    single_thread,
)
from torch import nn

from tiled_mlp.core import TiledCrossEntropy, tiled_cross_entropy
from tiled_mlp.core.sharded_autograd import LOSS_DOUBLE_BACKWARD_ERROR, SECOND_BACKWARD_ERROR

pytestmark = pytest.mark.timeout(60)
one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)

HEADS = {
    "linear-bias": lambda: linear_head(bias=True),
    "frozen-linear": lambda: linear_head(bias=True).requires_grad_(False),
    "module": lambda: module_head(),
}
WORK = {"mm", "addmm", "bmm", "matmul", "linear", "gather", "logsumexp", "exp", "exp_"}  # the loss's work


def with_old_grads(head: nn.Module, hidden: torch.Tensor):
    """Non-zero ``.grad`` already there (a previous micro-batch); returns copies to compare against."""
    hidden.requires_grad_().grad = torch.full_like(hidden, 0.25)
    for p in head.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 0.5)
    return {"hidden": hidden.grad.clone()} | {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def assert_grads_unchanged(head: nn.Module, hidden: torch.Tensor, before) -> None:
    now = {"hidden": hidden.grad} | {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
    assert now.keys() == before.keys()
    for name, g in before.items():
        assert torch.equal(now[name], g), name


def assert_added(want, head, hidden, before):
    """``.grad`` is now exactly ``before`` plus the reference run's gradients."""
    assert max_abs_diff(want.dx + before["hidden"], hidden.grad) <= 1e-12
    for name, p in head.named_parameters():
        if p.requires_grad:
            assert max_abs_diff(want.grads[name] + before[name], p.grad) <= 1e-12, name


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's leak note, not ours
@pytest.mark.parametrize("head", HEADS)
def test_double_backward_refused_and_nothing_consumed(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=40)
    want = loss_run(lambda x, m: hf_loss(m(x), labels), hidden, lm_head)
    before = with_old_grads(lm_head, hidden)
    loss = tiled_cross_entropy(hidden, lm_head, labels, num_shards=3)
    with pytest.raises(RuntimeError, match="double backward") as refused:
        loss.backward(create_graph=True)  # a gradient penalty, torch.autograd.functional.hessian
    assert LOSS_DOUBLE_BACKWARD_ERROR in str(refused.value)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, [hidden], create_graph=True, retain_graph=True)
    assert_grads_unchanged(lm_head, hidden, before)
    loss.backward()  # the refusals consumed nothing: a plain backward still adds the exact gradients
    assert_added(want, lm_head, hidden, before)


@pytest.mark.parametrize("head", HEADS)
def test_second_backward_through_one_call_refused(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=41)
    want = loss_run(lambda x, m: hf_loss(m(x), labels), hidden, lm_head, grad_scale=2)
    before = with_old_grads(lm_head, hidden)
    loss = tiled_cross_entropy(hidden, lm_head, labels, num_shards=3)
    (loss * 2).backward(retain_graph=True)
    assert_added(want, lm_head, hidden, before)
    after_first = {"hidden": hidden.grad.clone()} | {n: p.grad.clone() for n, p in lm_head.named_parameters()
                                                       if p.grad is not None}
    with pytest.raises(RuntimeError) as refused:
        loss.backward()
    assert SECOND_BACKWARD_ERROR in str(refused.value)
    assert_grads_unchanged(lm_head, hidden, after_first)


def bad_labels(value, position=(1, 4)):
    def edit(kwargs):
        kwargs["labels"] = kwargs["labels"].clone()
        kwargs["labels"][position] = value
    return edit


def set_(**changes):
    return lambda kwargs: kwargs.update(changes)


# (how the call is spoiled, the error's type, words it must contain)
BAD_CALLS = {
    "label == vocab": (bad_labels(VOCAB), ValueError, "outside the vocabulary"),
    "label > vocab": (bad_labels(VOCAB + 5), ValueError, "outside the vocabulary"),
    "negative label": (bad_labels(-5), ValueError, "outside the vocabulary"),
    "float labels": (lambda kw: kw.update(labels=kw["labels"].double()), TypeError, "integer tensor"),
    "bool labels": (lambda kw: kw.update(labels=kw["labels"] > 0), TypeError, "integer tensor"),
    "labels shape": (lambda kw: kw.update(labels=kw["labels"][:, :-1]), ValueError, "do not match"),
    "neither labels": (lambda kw: kw.update(labels=None), ValueError, "labels"),
    "reduction none": (set_(reduction="none"), ValueError, "reduction"),
    "reduction avg": (set_(reduction="avg"), ValueError, "reduction"),
    "label_smoothing < 0": (set_(label_smoothing=-0.1), ValueError, "label_smoothing"),
    "label_smoothing > 1": (set_(label_smoothing=1.5), ValueError, "label_smoothing"),
    "z_loss < 0": (set_(z_loss=-1e-3), ValueError, "z_loss"),
    "logit_softcap 0": (set_(logit_softcap=0), ValueError, "logit_softcap"),
    "logit_softcap < 0": (set_(logit_softcap=-30.0), ValueError, "logit_softcap"),
    "logit_softcap bool": (set_(logit_softcap=True), ValueError, "logit_softcap"),
    "num_shards 0": (set_(num_shards=0), ValueError, "num_shards"),
    "num_shards 2.5": (set_(num_shards=2.5), TypeError, "num_shards"),
    "num_shards 'x'": (set_(num_shards="x"), ValueError, "num_shards"),
    "lm_head a tensor": (lambda kw: kw.update(lm_head=kw["lm_head"].weight), TypeError, "nn.Module"),
    "lm_head a function": (lambda kw: kw.update(lm_head=torch.nn.functional.gelu), TypeError, "nn.Module"),
    "hidden size": (lambda kw: kw.update(lm_head=linear_head(hidden=HIDDEN + 1)), ValueError, "in_features"),
    "integer hidden": (lambda kw: kw.update(hidden=kw["labels"].clone()[..., None]), ValueError, "floating-point"),
    "unknown strategy": (set_(strategy="nope"), KeyError, "unknown strategy"),
    "grad_accum_dtype int32": (set_(grad_accum_dtype=torch.int32), TypeError, "grad_accum_dtype"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_call_refused_before_any_work(case):
    spoil, error, words = BAD_CALLS[case]
    head = linear_head(bias=True)
    hidden, labels = hidden_batch(seed=42)
    before = with_old_grads(head, hidden)
    kwargs = dict(hidden=hidden, lm_head=head, labels=labels, num_shards=3)
    spoil(kwargs)
    with OpLog() as log, pytest.raises(error, match=words):
        tiled_cross_entropy(**kwargs)
    assert not WORK & set(log.ops), sorted(WORK & set(log.ops))
    assert_grads_unchanged(head, hidden, before)


def test_op_log_sees_the_work_of_a_call_that_runs():
    """The check above means something: a call that is not refused shows its matmuls in the log."""
    hidden, labels = hidden_batch(seed=42)
    with OpLog() as log:
        tiled_cross_entropy(hidden, linear_head(bias=True), labels, num_shards=3)
    assert {"mm", "addmm"} <= set(log.ops)


def test_out_of_range_label_at_the_first_position_is_never_read():
    """Position 0's label predicts nothing after the shift (as in ForCausalLMLoss): not refused, not read."""
    head = linear_head()
    hidden, labels = hidden_batch(seed=43)
    labels[:, 0] = VOCAB + 100
    assert_same_run(loss_run(lambda x, m: hf_loss(m(x), labels), hidden, head),
                    loss_run(lambda x, m: tiled_cross_entropy(x, m, labels, num_shards=3), hidden, head))


@pytest.mark.parametrize("label", [VOCAB, -5])
def test_out_of_range_label_refused_for_a_head_without_out_features(label):
    """A head with no ``out_features`` or ``weight`` of its own (ScaledLoRAHead) still has a vocabulary: its
    logits' width. An out-of-range label must be refused as for an nn.Linear, not reach ``gather``
    (on CPU torch's 'index out of bounds' from inside the first shard; on CUDA a device-side assert)."""
    head = module_head()
    assert not hasattr(head, "out_features") and not hasattr(head, "weight")
    hidden, labels = hidden_batch(seed=44)
    labels[1, 4] = label
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiled_cross_entropy(hidden, head, labels, num_shards=3)


class HeadWithAForeignTensor(ScaledLoRAHead):
    """Reads a tensor that requires grad but is not its parameter: its gradient would be silently lost."""

    def __init__(self):
        super().__init__(HIDDEN, VOCAB)
        self.temperature = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)  # not a Parameter

    def forward(self, x):
        return super().forward(x) * self.temperature


def test_head_reading_a_foreign_tensor_that_requires_grad_refused():
    torch.manual_seed(0)
    head = HeadWithAForeignTensor().double()
    hidden, labels = hidden_batch(seed=45)
    before = with_old_grads(head, hidden)
    with pytest.raises(RuntimeError, match="besides its parameters"):
        tiled_cross_entropy(hidden, head, labels, num_shards=3)
    assert head.temperature.grad is None
    assert_grads_unchanged(head, hidden, before)


BAD_OPTIONS = {
    "reduction none": (dict(reduction="none"), ValueError),
    "label_smoothing < 0": (dict(label_smoothing=-0.1), ValueError),
    "label_smoothing > 1": (dict(label_smoothing=1.5), ValueError),
    "z_loss < 0": (dict(z_loss=-1e-3), ValueError),
    "logit_softcap 0": (dict(logit_softcap=0), ValueError),
    "num_shards 0": (dict(num_shards=0), ValueError),
    "num_shards 2.5": (dict(num_shards=2.5), TypeError),
    "num_shards 'x'": (dict(num_shards="x"), ValueError),
    "unknown strategy": (dict(strategy="nope"), KeyError),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_module_form_rejects_bad_options_when_built(case):
    """At construction, as ``nn.CrossEntropyLoss``'s options are fixed there: not at the first training step."""
    options, error = BAD_OPTIONS[case]
    with pytest.raises(error):
        TiledCrossEntropy(**options)
