"""``tiled_cross_entropy`` equals Hugging Face's ``ForCausalLMLoss`` on ``lm_head(hidden)`` in float64,
loss and every gradient, whatever the shard count; every gradient (the head's included) is scaled by the
gradient that reaches the loss; no ``[tokens, vocab]`` tensor is ever allocated.

The options (shift, ignore_index, reductions, smoothing, soft-capping, z-loss, tied/LoRA/PEFT heads,
bf16) are in test_tiled_loss_options.py, the refusals in test_tiled_loss_errors.py.
"""
from __future__ import annotations

import pytest
import torch
from loss_reference import (
    HIDDEN,
    VOCAB,
    LargestTensor,
    assert_same_run,
    hf_loss,
    hidden_batch,
    linear_head,
    loss_run,
    module_head,
    shifted,
    single_thread,
)
from torch import nn

from tiled_mlp.core import TiledCrossEntropy, tiled_cross_entropy

pytestmark = pytest.mark.timeout(60)
one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)

# 18 tokens (2 x 9): 1 shard (untiled work), uneven shards, and more shards than tokens (empty shards).
SHARD_COUNTS = [1, 3, 7, 40, "auto"]
HEADS = {
    "linear": lambda: linear_head(),
    "linear-bias": lambda: linear_head(bias=True),
    "module": lambda: module_head(),  # generic ModuleHeadKernel: the head's forward under autograd
}


def tiled_loss_fn(labels, **kwargs):
    return lambda x, head: tiled_cross_entropy(x, head, labels, **kwargs)


def hf_reference(labels, **kwargs):
    return lambda x, head: hf_loss(head(x), labels, **kwargs)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("num_shards", SHARD_COUNTS)
def test_loss_and_every_grad_equal_to_hf_in_float64(head, num_shards):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=num_shards if isinstance(num_shards, int) else 0)
    want = loss_run(hf_reference(labels), hidden, lm_head)
    have = loss_run(tiled_loss_fn(labels, num_shards=num_shards), hidden, lm_head)
    assert have.loss.dtype == torch.float64  # a float64 head keeps float64 loss math
    assert all(g is not None for g in have.grads.values())  # the test compares every head gradient
    assert_same_run(want, have)


def non_contiguous(x):
    """The same values with rows 2 * hidden apart (a slice of a wider buffer, as a model may hand over)."""
    view = torch.cat([x, x], dim=-1)[..., : x.shape[-1]]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("shape", [(3, 2, 5), (1, 17), (4, 1, 1, 6)])
def test_leading_dims_and_non_contiguous_hidden(shape):
    head = linear_head(bias=True)
    hidden, labels = hidden_batch(shape, seed=len(shape), ignored=1)
    want = loss_run(hf_reference(labels), hidden, head)
    assert_same_run(want, loss_run(tiled_loss_fn(labels, num_shards=4), hidden, head))
    assert_same_run(want, loss_run(lambda x, m: tiled_cross_entropy(non_contiguous(x), m, labels, num_shards=4), hidden, head))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("grad_scale", [3.7, 1 / 11])
def test_every_grad_scaled_by_the_incoming_gradient(head, grad_scale):
    """``(loss * c).backward()``: the head's gradient too (DeepSpeed's TiledFusedLogitsLoss scales only the
    input's). 3.7 and 1/11 (gradient accumulation's ``loss / steps``) are not powers of two."""
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=5)
    want = loss_run(hf_reference(labels), hidden, lm_head, grad_scale=grad_scale)
    have = loss_run(tiled_loss_fn(labels, num_shards=3), hidden, lm_head, grad_scale=grad_scale)
    assert_same_run(want, have)
    # And not by accident: unscaled gradients are far from these.
    plain = loss_run(tiled_loss_fn(labels, num_shards=3), hidden, lm_head)
    for name, g in have.grads.items():
        assert torch.allclose(g, plain.grads[name] * grad_scale, rtol=1e-12, atol=0), name


@pytest.mark.parametrize("head", ["linear-bias", "module"])
def test_shard_with_only_ignored_labels_contributes_exact_zeros(head):
    """First half of the shifted labels ignored, 4 shards: the first two shards have no valid token. Nothing
    is divided per shard, so they add exact zeros (never 0/0 = NaN) and their tokens' gradient is 0."""
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch((1, 16), seed=7, ignored=9)  # shifted: positions 0..7 predict -100
    assert (shifted(labels)[0, :8] == -100).all() and (shifted(labels)[0, 8:15] != -100).all()
    want = loss_run(hf_reference(labels), hidden, lm_head)
    have = loss_run(tiled_loss_fn(labels, num_shards=4), hidden, lm_head)
    assert torch.isfinite(have.loss) and all(torch.isfinite(g).all() for g in have.grads.values())
    assert_same_run(want, have)
    assert (have.dx[0, :8] == 0).all() and (have.dx[0, -1] == 0).all()  # exact zeros, not tiny numbers


def test_no_valid_token_at_all_gives_nan_as_hf():
    """0 valid tokens: the mean is 0/0, NaN, as ``F.cross_entropy`` and ``ForCausalLMLoss`` give."""
    head = linear_head()
    hidden, labels = hidden_batch(seed=8, ignored=0)
    labels.fill_(-100)
    assert torch.isnan(hf_loss(head(hidden), labels))
    assert torch.isnan(tiled_cross_entropy(hidden, head, labels, num_shards=3))


@pytest.mark.parametrize("head", HEADS)
def test_no_valid_token_masked_out_gives_zero_gradients_as_hf(head):
    """The NaN mean masked away (``torch.where``, as the Trainer's SP loss does for a rank without labels):
    every gradient is exactly 0, as F.cross_entropy's, never 0 * (1/0) = NaN."""
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=8, ignored=0)
    labels.fill_(-100)
    want = loss_run(lambda h, m: torch.where(torch.tensor(False), hf_loss(m(h), labels), 0.0), hidden, lm_head)
    have = loss_run(lambda h, m: torch.where(torch.tensor(False), tiled_cross_entropy(h, m, labels, num_shards=3), 0.0),
               hidden, lm_head)
    assert (have.dx == 0).all() and all((g == 0).all() for g in have.grads.values() if g is not None)
    assert_same_run(want, have)


@pytest.mark.parametrize("head", HEADS)
def test_frozen_head_only_hidden_gets_a_grad(head):
    lm_head = HEADS[head]().requires_grad_(False)
    hidden, labels = hidden_batch(seed=9)
    want = loss_run(hf_reference(labels), hidden, lm_head)
    have = loss_run(tiled_loss_fn(labels, num_shards=3), hidden, lm_head)
    assert all(g is None for g in have.grads.values()) and have.dx is not None
    assert_same_run(want, have)


@pytest.mark.parametrize("head", HEADS)
def test_hidden_without_grad_only_head_grads(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=10)
    want = loss_run(hf_reference(labels), hidden, lm_head, hidden_grad=False)
    have = loss_run(tiled_loss_fn(labels, num_shards=3), hidden, lm_head, hidden_grad=False)
    assert have.dx is None and all(g is not None for g in have.grads.values())
    assert_same_run(want, have)


def test_partly_frozen_head_grads_only_for_the_trainable_part():
    """A frozen weight with a trainable bias: the bias alone gets its (exact) gradient."""
    head = linear_head(bias=True)
    head.weight.requires_grad_(False)
    hidden, labels = hidden_batch(seed=11)
    want = loss_run(hf_reference(labels), hidden, head)
    have = loss_run(tiled_loss_fn(labels, num_shards=3), hidden, head)
    assert have.grads["weight"] is None and have.grads["bias"] is not None
    assert_same_run(want, have)


@pytest.mark.parametrize("head", HEADS)
def test_under_no_grad_the_value_without_a_graph(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=12)
    hidden.requires_grad_()
    with torch.no_grad():
        loss = tiled_cross_entropy(hidden, lm_head, labels, num_shards=3)
        want = hf_loss(lm_head(hidden), labels)
    assert loss.grad_fn is None and not loss.requires_grad
    assert abs(loss.item() - want.item()) <= 1e-12


@pytest.mark.parametrize("head", ["linear-bias", "module"])
def test_two_losses_and_micro_batches_accumulate_into_grad(head):
    """Two calls summed into one backward, then a second micro-batch's backward on top of existing ``.grad``
    (gradient accumulation): both as autograd accumulates the untiled losses."""
    lm_head = HEADS[head]()
    (h1, l1), (h2, l2), (h3, l3) = (hidden_batch(seed=s) for s in (13, 14, 15))

    def three_losses(loss_fn):
        def both(x, head):
            first = loss_fn(x, head, l1) + 0.5 * loss_fn(h2, head, l2)  # two calls, one backward
            first.backward()
            return loss_fn(h3, head, l3) / 2  # the next micro-batch, backward by ``run``
        return both

    want = loss_run(three_losses(lambda x, head, lab: hf_loss(head(x), lab)), h1, lm_head)
    have = loss_run(three_losses(lambda x, head, lab: tiled_cross_entropy(x, head, lab, num_shards=3)), h1, lm_head)
    assert_same_run(want, have)


def test_module_form_equals_the_function():
    head = linear_head(bias=True)
    hidden, labels = hidden_batch(seed=16)
    options = dict(ignore_index=-100, reduction="sum", label_smoothing=0.1, logit_softcap=4.0, z_loss=1e-3,
                   num_shards=3, grad_accum_dtype=torch.float64)
    loss_fn = TiledCrossEntropy(**options)
    assert list(loss_fn.parameters()) == [] and "z_loss=0.001" in repr(loss_fn)
    want = loss_run(tiled_loss_fn(labels, **options), hidden, head)
    assert_same_run(want, loss_run(lambda x, m: loss_fn(x, m, labels), hidden, head), atol=0)
    # shift_labels and num_items_in_batch go through the call, as to the function.
    want = loss_run(lambda x, m: tiled_cross_entropy(x, m, shift_labels=shifted(labels), num_items_in_batch=7, **options),
               hidden, head)
    have = loss_run(lambda x, m: loss_fn(x, m, shift_labels=shifted(labels), num_items_in_batch=7), hidden, head)
    assert_same_run(want, have, atol=0)


def test_logits_are_never_held():
    """4096 tokens x 5000 vocab in float32, 8 shards: no op, forward or backward, produces a tensor as
    large as the logits; the largest is one shard's [512, 5000]. With 1 shard the same tracker sees the
    full [4096, 5000] buffer, so it would catch one."""
    tokens, vocab, hidden_size = 4096, 5000, 8
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab)
    hidden = torch.randn(2, tokens // 2, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens // 2))

    with LargestTensor() as tracker:
        tiled_cross_entropy(hidden, head, labels, num_shards=8).backward()
    assert tracker.numel < tokens * vocab, (tracker.op, tracker.shape)
    assert tracker.numel == (tokens // 8) * vocab, (tracker.op, tracker.shape)
    assert hidden.grad is not None and head.weight.grad is not None
    with LargestTensor() as one_shard, torch.no_grad():  # the forward alone is enough to see it
        tiled_cross_entropy(hidden, head, labels, num_shards=1)
    assert one_shard.numel >= tokens * vocab


class ReportsOtherSizes(nn.Module):
    """A wrapper whose ``in_features`` and ``out_features`` are another module's, swapped (PEFT's
    ``modules_to_save`` on a tied embedding reports the embedding's), around a head that computes right."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.head = head
        self.in_features, self.out_features = head.out_features, head.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, x):
        return self.head(x)


def test_a_head_that_reports_sizes_its_weight_contradicts_is_sized_by_what_it_computes():
    # The sizes a head reports are trusted where its weight agrees; here they are not, and the head's logits
    # show the vocabulary instead (labels up to VOCAB - 1 are valid, HIDDEN < VOCAB).
    hidden, labels = hidden_batch(seed=5)
    assert int(labels.max()) >= HIDDEN
    head = ReportsOtherSizes(linear_head())
    want = loss_run(lambda x, m: hf_loss(m(x), labels), hidden, head)
    assert_same_run(want, loss_run(tiled_loss_fn(labels, num_shards=3), hidden, head))
    assert head.in_features == VOCAB
