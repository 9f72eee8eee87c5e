"""The tiled loss's options, each against its untiled reference: Hugging Face's shift and normalisation
(``shift_labels``, ``ignore_index``, ``num_items_in_batch``), the options Hugging Face leaves to the model
(label smoothing, Gemma 2's soft-capping, z-loss), the heads a model holds (tied to the embeddings, a
head with a forward of its own, PEFT's LoRA), and the float32 loss math from bf16 weights."""
from __future__ import annotations

import copy
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from loss_reference import (
    HIDDEN,
    VOCAB,
    assert_same_run,
    hf_loss,
    hidden_batch,
    linear_head,
    loss_run,
    max_abs_diff,
    module_head,
    option_reference,
    shifted,
    single_thread,
)
from torch import nn

from tiled_mlp.core import tiled_cross_entropy
from tiled_mlp.core.kernels.lm_head import LinearHeadKernel, ModuleHeadKernel

pytestmark = pytest.mark.timeout(60)
one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)

HEADS = {"linear-bias": lambda: linear_head(bias=True), "module": lambda: module_head()}


def tiled_options_fn(labels=None, **kwargs):
    return lambda x, head: tiled_cross_entropy(x, head, labels, **kwargs)


# -- Hugging Face's shift and normalisation -----------------------------------------------------------------
@pytest.mark.parametrize("head", HEADS)
def test_pre_shifted_labels_equal_labels_shifted_here(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=20)
    from_labels = loss_run(tiled_options_fn(labels, num_shards=3), hidden, lm_head)
    from_shifted = loss_run(tiled_options_fn(shift_labels=shifted(labels), num_shards=3), hidden, lm_head)
    assert_same_run(from_labels, from_shifted, atol=0)  # the same targets: bit for bit
    assert_same_run(loss_run(lambda x, m: hf_loss(m(x), labels), hidden, lm_head), from_labels)


def test_shift_labels_are_taken_as_given():
    """Under sequence parallelism a rank's shifted labels have no ignored last position: nothing is
    shifted or dropped again (a second shift would lose the last target and misalign the rest)."""
    head = linear_head(bias=True)
    hidden, targets = hidden_batch(seed=21, ignored=0)
    want = loss_run(lambda x, m: hf_loss(m(x), None, shift_labels=targets), hidden, head)
    assert_same_run(want, loss_run(tiled_options_fn(shift_labels=targets, num_shards=4), hidden, head))


@pytest.mark.parametrize("ignore_index", [-100, -1, 7])  # 7: a vocabulary id, ignored as a label
@pytest.mark.parametrize("head", HEADS)
def test_ignore_index(ignore_index, head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=22, ignored=0)
    labels[0, 3:6] = ignore_index
    labels[1, -2:] = ignore_index
    want = loss_run(lambda x, m: hf_loss(m(x), labels, ignore_index=ignore_index), hidden, lm_head)
    assert_same_run(want, loss_run(tiled_options_fn(labels, ignore_index=ignore_index, num_shards=3), hidden, lm_head))


def sum_reference(labels):
    return lambda x, m: F.cross_entropy(m(x).flatten(0, -2), shifted(labels).flatten(), reduction="sum")


@pytest.mark.parametrize("head", HEADS)
def test_mean_sum_and_num_items_in_batch(head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=23)
    assert_same_run(loss_run(lambda x, m: hf_loss(m(x), labels), hidden, lm_head),
                    loss_run(tiled_options_fn(labels, reduction="mean", num_shards=3), hidden, lm_head))
    assert_same_run(loss_run(sum_reference(labels), hidden, lm_head),
                    loss_run(tiled_options_fn(labels, reduction="sum", num_shards=3), hidden, lm_head), atol=1e-11)  # sums of ~16 terms
    # The Trainer's count overrides the reduction (the sum over it), given as an int or a tensor.
    for count in (23, torch.tensor(23)):
        want = loss_run(lambda x, m, count=count: hf_loss(m(x), labels, num_items_in_batch=count), hidden, lm_head)
        for reduction in ("mean", "sum"):
            have = loss_run(tiled_options_fn(labels, reduction=reduction, num_items_in_batch=count, num_shards=3), hidden, lm_head)
            assert_same_run(want, have)


# -- the options Hugging Face leaves to the model --------------------------------------------------------------
@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("head", HEADS)
def test_label_smoothing_as_f_cross_entropy(eps, head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=24)
    want = loss_run(lambda x, m: option_reference(m(x), labels, label_smoothing=eps), hidden, lm_head)
    assert_same_run(want, loss_run(tiled_options_fn(labels, label_smoothing=eps, num_shards=3), hidden, lm_head))


@pytest.mark.parametrize("cap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("head", HEADS)
def test_logit_softcap_as_gemma2(cap, head):
    """Gemma 2's forward: ``logits = cap * tanh(logits / cap)``, then Hugging Face's loss. The head's logits
    here reach about +-4, so 0.5 and 2.0 change the loss a lot and 30.0 a little."""
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=25)
    want = loss_run(lambda x, m: hf_loss(cap * torch.tanh(m(x) / cap), labels), hidden, lm_head)
    assert_same_run(want, loss_run(tiled_options_fn(labels, logit_softcap=cap, num_shards=3), hidden, lm_head))
    assert abs(want.loss - hf_loss(lm_head(hidden), labels)) > 1e-6  # the cap mattered


@pytest.mark.parametrize("lam", [1e-4, 0.1])
@pytest.mark.parametrize("head", HEADS)
def test_z_loss(lam, head):
    lm_head = HEADS[head]()
    hidden, labels = hidden_batch(seed=26)
    want = loss_run(lambda x, m: option_reference(m(x), labels, z_loss=lam), hidden, lm_head)
    assert_same_run(want, loss_run(tiled_options_fn(labels, z_loss=lam, num_shards=3), hidden, lm_head))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("num_shards", [1, 7, 40])
def test_all_options_together(reduction, num_shards):
    """Soft-capping, smoothing and z-loss at once (z-loss on the capped logits), a custom ignore_index, a
    bias; "sum" is the mean times the number of valid tokens."""
    head = linear_head(bias=True, seed=3)
    hidden, labels = hidden_batch(seed=27, ignored=0)
    labels[:, 4:6] = -1
    options = dict(ignore_index=-1, label_smoothing=0.2, logit_softcap=1.5, z_loss=0.05)
    valid = int((shifted(labels, -1) != -1).sum())
    factor = valid if reduction == "sum" else 1
    want = loss_run(lambda x, m: option_reference(m(x), labels, **options) * factor, hidden, head)
    have = loss_run(tiled_options_fn(labels, reduction=reduction, num_shards=num_shards, **options), hidden, head)
    assert_same_run(want, have, atol=1e-11 if reduction == "sum" else 1e-12)


# -- heads ----------------------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """Embedding -> a layer -> lm_head, the head's weight the embedding's Parameter (tie_word_embeddings)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def hidden(self, ids):
        return torch.tanh(self.layer(self.embed(ids)))


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_tied_embeddings_get_both_paths_gradients(num_shards):
    torch.manual_seed(4)
    model = TiedLM().double()
    assert model.lm_head.weight is model.embed.weight
    _, labels = hidden_batch(seed=28)
    ids = labels.clamp_min(0)

    def grads(loss_fn):
        m = copy.deepcopy(model)
        assert m.lm_head.weight is m.embed.weight  # still one Parameter in the copy
        loss = loss_fn(m.hidden(ids), m.lm_head)
        (loss * 3.7).backward()
        return {"loss": loss.detach()} | {n: p.grad for n, p in m.named_parameters()}  # the shared weight once

    want = grads(lambda h, head: hf_loss(head(h), labels))
    have = grads(lambda h, head: tiled_cross_entropy(h, head, labels, num_shards=num_shards))
    assert want.keys() == have.keys() == {"loss", "embed.weight", "layer.weight", "layer.bias"}
    for name in want:
        assert max_abs_diff(want[name], have[name]) <= 1e-12, name


class HalvingLinear(nn.Linear):
    """An nn.Linear whose class overrides forward: not a plain Linear, so not read as one."""

    def forward(self, x):
        return super().forward(x) * 0.5


def patched_linear():
    """An nn.Linear given an instance forward (as a hooking library does); bound, so a deep copy reads its own
    weight."""
    head = linear_head(bias=True)
    head.forward = types.MethodType(lambda self, x: F.linear(x, self.weight, self.bias) * 0.5, head)
    return head


@pytest.mark.parametrize("build, kernel", [
    (lambda: linear_head(bias=True), LinearHeadKernel),
    (lambda: HalvingLinear(HIDDEN, VOCAB).double(), ModuleHeadKernel),
    (patched_linear, ModuleHeadKernel),
    (module_head, ModuleHeadKernel),
], ids=["linear", "linear-subclass-forward", "instance-forward", "lora-style"])
def test_kernel_chosen_by_what_the_head_is_and_equal_to_its_forward(build, kernel):
    """A head whose forward is not nn.Linear's takes the generic path, which runs that forward: reading it as
    a plain Linear would drop the 0.5."""
    head = build()
    hidden, labels = hidden_batch(seed=29)
    with mock.patch.object(kernel, "shard", autospec=True, side_effect=kernel.shard) as shard:
        have = loss_run(tiled_options_fn(labels, num_shards=3), hidden, head)
    assert shard.call_count == 3
    assert_same_run(loss_run(lambda x, m: hf_loss(m(x), labels), hidden, head), have)


def test_peft_lora_lm_head_every_trainable_grad():
    peft = pytest.importorskip("peft")

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(HIDDEN, HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB)

    torch.manual_seed(5)
    # init_lora_weights=False: lora_B random, not zero, so lora_A's gradient is not zero either.
    config = peft.LoraConfig(target_modules=["lm_head"], r=4, lora_alpha=8, init_lora_weights=False)
    model = peft.get_peft_model(TinyLM(), config).double()
    hidden, labels = hidden_batch(seed=30)

    def grads(loss_fn):
        m = copy.deepcopy(model)
        x = hidden.detach().clone().requires_grad_()
        h = torch.tanh(m.base_model.model.body(x))
        (loss_fn(h, m.base_model.model.lm_head) / 11).backward()
        return {n: p.grad for n, p in m.named_parameters() if p.requires_grad} | {"x": x.grad}

    want = grads(lambda h, head: hf_loss(head(h), labels))
    have = grads(lambda h, head: tiled_cross_entropy(h, head, labels, num_shards=3))
    assert any("lora_A" in n for n in want) and any("lora_B" in n for n in want) and "x" in want
    assert not any("lm_head.base_layer" in n for n in want)  # PEFT froze the base head
    for name in want:
        assert want[name].abs().max() > 0 and max_abs_diff(want[name], have[name]) <= 1e-12, name


# -- float32 loss math from bf16 weights -----------------------------------------------------------------
BF16 = dict(hidden=64, vocab=300)


def bf16_case(seed):
    head = linear_head(seed, dtype=torch.bfloat16, **BF16)
    hidden, labels = hidden_batch((1, 100), seed=seed, ignored=5, dtype=torch.bfloat16, **BF16)
    return head, hidden, labels


@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_bf16_head_loss_in_float32_equal_to_hf(num_shards):
    """The loss is float32 (ForCausalLMLoss's ``logits.float()``), the gradients bf16. Measured over 20 seeds x
    1/3/7 shards: the loss differs from ForCausalLMLoss's by <= 1.5e-6, 3 float32 ulps at a loss near 6 (a
    float32 sum in another order); dx by <= 0.005 of max|dx|, one bf16 rounding of the largest entries
    (bf16 spacing is 2**-7 relative: the softmax summed in another order can round a gradient the other way)."""
    for seed in range(3):
        head, hidden, labels = bf16_case(seed)
        want = loss_run(lambda x, m, labels=labels: hf_loss(m(x), labels, downcast=True), hidden, head)
        have = loss_run(tiled_options_fn(labels, num_shards=num_shards), hidden, head)
        assert have.loss.dtype == want.loss.dtype == torch.float32
        assert have.dx.dtype == have.grads["weight"].dtype == torch.bfloat16
        assert max_abs_diff(want.loss, have.loss) <= 2e-6, seed
        assert max_abs_diff(want.dx, have.dx) <= 2**-7 * want.dx.abs().max(), seed


def test_grad_accum_dtype_float32_sums_the_weight_grad_closer():
    """50 shards of 2 tokens: summing the bf16 head's gradient over shards in bf16 rounds 50 times. Measured
    against float64 (max abs): bf16 sums 5.9e-4, float32 sums 1.9e-4 (the one bf16 rounding at the end)."""
    head, hidden, labels = bf16_case(0)
    want = loss_run(lambda x, m: hf_loss(m(x), labels), hidden.double(), copy.deepcopy(head).double())

    def weight_error(accum):
        have = loss_run(tiled_options_fn(labels, num_shards=50, grad_accum_dtype=accum), hidden, head)
        assert have.grads["weight"].dtype == torch.bfloat16  # delivered in the parameter's dtype
        return max_abs_diff(want.grads["weight"], have.grads["weight"])

    default, wide = weight_error(None), weight_error(torch.float32)
    assert wide < 0.5 * default, (wide, default)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_as_hf(hidden_dtype):
    """Mixed precision as the Trainer's bf16=True runs it: float32 weights, bf16 matmuls by autocast, the
    loss computed inside the autocast region (in the model's forward). Measured with 1 shard over 10 seeds:
    loss within 1.5e-6, gradients within 0.0064 of their max (dx; bias 0.0048, weight 0.0003): Hugging
    Face rounds the logits' gradient to bf16 and its backward matmul's output again. Bounds: 2e-6, 2**-6."""
    head = linear_head(bias=True, dtype=torch.float32, **BF16)
    hidden, labels = hidden_batch((2, 50), seed=31, dtype=hidden_dtype, **BF16)

    def under_autocast(loss_fn):
        def call(x, m):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return loss_fn(x, m)
        return call

    want = loss_run(under_autocast(lambda x, m: hf_loss(m(x), labels, downcast=True)), hidden, head)
    for num_shards in (1, 3):
        have = loss_run(under_autocast(tiled_options_fn(labels, num_shards=num_shards)), hidden, head)
        assert max_abs_diff(want.loss, have.loss) <= 2e-6
        for name, g in [("dx", have.dx), *have.grads.items()]:
            ref = want.dx if name == "dx" else want.grads[name]
            assert g.dtype == ref.dtype and max_abs_diff(ref, g) <= 2**-6 * ref.abs().max(), (num_shards, name)


def test_both_labels_and_shift_labels_use_shift_labels_as_hugging_face():
    """The Trainer passes both under context and sequence parallelism; ForCausalLMLoss uses shift_labels."""
    lm_head = HEADS["linear-bias"]()
    hidden, labels = hidden_batch(seed=60)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].roll(1, dims=-1)  # not labels' shift
    want = loss_run(tiled_options_fn(None, shift_labels=shifted, num_shards=3), hidden, lm_head)
    have = loss_run(tiled_options_fn(labels, shift_labels=shifted, num_shards=3), hidden, lm_head)
    assert_same_run(want, have, atol=0)
