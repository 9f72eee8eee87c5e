"""Ninth review, in process: ``torch.compile(fullgraph=True, dynamic=True)`` of a tiny Llama with the tiled MLP,
norms and loss, over one sequence of calls that switches what a user switches between steps: the length and the
batch size, a padding mask, label smoothing set after compiling, ``num_items_in_batch``, train and eval, with and
without a graph. Each call against the untiled model in eager mode, float64. No finding: measured worst 5.6e-16.

Without a graph and without smoothing the tiled loss hands the call to the model's own forward (docs/
long-context-stack.md), whose loss takes float32 logits (HF's ``logits.float()``): there the compiled call equals the
untiled model's own output exactly, not the float64 reference (1.1e-8 off it, as the untiled model is)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp import apply_tiled_mlp  # noqa: E402
from tiled_mlp.integrations import set_tiled_loss_label_smoothing  # noqa: E402

BOUND = 1e-12
# (tokens, samples, label smoothing, padding mask, num_items_in_batch, mode, graph)
CALLS = [(16, 1, 0.0, False, None, "train", True), (24, 2, 0.0, True, None, "train", True),
         (20, 2, 0.1, True, 50, "train", True), (20, 2, 0.1, True, None, "eval", False),
         (33, 1, 0.1, False, None, "eval", True), (16, 3, 0.0, True, 40, "train", True),
         (18, 2, 0.0, False, None, "eval", False)]


def _smoothed_reference_loss(model, ids, labels, mask, smoothing, count):
    logits = model(input_ids=ids, attention_mask=mask).logits
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                label_smoothing=smoothing, reduction="none")
    return per_token.sum() / (count if count is not None else (targets != -100).sum())


@pytest.mark.timeout(60)
def test_compiled_tiled_model_across_switches_between_calls_equals_the_untiled_model():
    torch._dynamo.reset()
    reference = tiny_model("llama", seed=0, dtype=torch.float64)
    reference.set_attn_implementation("sdpa")
    del reference.model.layers[1:]
    reference.config.num_hidden_layers = 1
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=2, loss=True, loss_num_shards=3, norms=True)
    compiled = torch.compile(tiled, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, (tokens, samples, smoothing, padded, count, mode, graph) in enumerate(CALLS):
        set_tiled_loss_label_smoothing(tiled, smoothing)
        getattr(tiled, mode)()
        getattr(reference, mode)()
        ids = torch.randint(0, VOCAB, (samples, tokens), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[:, :3] = -100
        mask = None
        if padded:
            mask = torch.ones_like(ids)
            mask[-1, :4] = 0
            labels[-1, :4] = -100
        extra = {} if count is None else {"num_items_in_batch": torch.tensor(count)}
        with torch.set_grad_enabled(graph):
            got = compiled(input_ids=ids, labels=labels, attention_mask=mask, **extra).loss
            if not graph and smoothing == 0.0:  # the model's own forward: HF's float32 loss
                want = reference(input_ids=ids, labels=labels, attention_mask=mask).loss
            else:
                want = _smoothed_reference_loss(reference, ids, labels, mask, smoothing, count)
        assert abs(got.item() - want.item()) <= BOUND * abs(want.item()), (i, got.item(), want.item())
        if graph:
            got.backward()
            want.backward()
            for (name, p), q in zip(reference.named_parameters(), tiled.parameters(), strict=True):
                err = float((q.grad - p.grad).abs().max() / p.grad.abs().max())
                assert err <= BOUND, (i, name, err)
            reference.zero_grad()
            tiled.zero_grad()
    torch._dynamo.reset()
