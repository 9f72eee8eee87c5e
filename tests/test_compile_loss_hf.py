"""``torch.compile`` of a Hugging Face causal LM with tiled MLPs and the tiled loss: it runs, and its loss
and every parameter gradient equal the untiled model's in eager mode (float32; measured: loss equal, gradients
within 3e-8). The tiled forward's own frame and the loss kernel run eagerly; the model's forward is compiled.
``aot_eager`` (Dynamo and AOT autograd, no code generation): inductor gave the same numbers in a one-off check
but takes minutes to compile on two CPU cores."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp import apply_tiled_mlp  # noqa: E402

ATOL = 1e-6  # float32: the compiled graphs may order sums differently


@pytest.mark.timeout(120)
def test_compiled_model_with_tiled_mlp_and_loss_equals_the_untiled_model():
    torch._dynamo.reset()
    config = tiny_model("llama").config
    config.num_hidden_layers = 1  # one layer: the compile time is per graph, and the graphs repeat per layer
    torch.manual_seed(0)
    reference = type(tiny_model("llama"))(config).float()
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=2, loss=True, loss_num_shards=3)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    compiled = torch.compile(tiled, backend="aot_eager")
    got = compiled(input_ids=ids, labels=labels)
    assert got.logits is None  # the tiled loss ran: no logits held
    got.loss.backward()
    want = reference(input_ids=ids, labels=labels).loss
    want.backward()
    assert abs(got.loss.item() - want.item()) <= ATOL
    for (name, p), q in zip(reference.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=ATOL, msg=name)
    torch._dynamo.reset()
