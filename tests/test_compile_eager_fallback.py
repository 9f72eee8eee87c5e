"""torch.compile on a torch whose Dynamo cannot trace a tiled call as one op (torch < 2.9,
``tiled_mlp.core.dynamo_support``): every tiled call runs eagerly behind a graph break, says why, and stays
exact; ``fullgraph=True`` raises at the break instead of compiling something else.

On torch >= 2.9 this path is forced by setting the flag the routes read, so CI proves it too; on an older
torch the flag is already off and these run as they are.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tiled_mlp import TiledMLP, tiled_cross_entropy
from tiled_mlp.core import compiled_route, dynamo_support, tiled_loss

try:
    from tiled_mlp.integrations import causal_lm_loss
except ImportError:  # without transformers: the loss alone still runs here
    causal_lm_loss = None  # type: ignore[assignment]

pytestmark = pytest.mark.timeout(60)

BOUND = 1e-12  # float64


# Not traced (a traced raise would only abort the trace, and the frame would then run eagerly, unseen):
# called at run time, so reaching it fails the test.
@torch.compiler.disable
def _unreachable(*args, **kwargs):
    raise AssertionError("a route decided by assume_constant_result was reached on the eager fallback")


@pytest.fixture(autouse=True)
def eager_fallback(monkeypatch):
    monkeypatch.setattr(dynamo_support, "TRACES_TILED_CALLS", False)
    # On a torch that can trace them these would run; the fallback must not reach any of them.
    monkeypatch.setattr(compiled_route, "_traced_route", _unreachable)
    monkeypatch.setattr(tiled_loss, "_traced_as_op", _unreachable)
    if causal_lm_loss is not None:
        monkeypatch.setattr(causal_lm_loss, "_traced_names", _unreachable)
        monkeypatch.setattr(causal_lm_loss, "_checked_where_traced", _unreachable)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiled_llama_and_ids():
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import VOCAB, tiny_model
    from tiled_mlp import apply_tiled_mlp

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_tiled_mlp(model, num_shards=2, loss=True, loss_num_shards=3, norms=True)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 13), generator=generator)
    return reference, model, ids, VOCAB


def test_a_compiled_tiny_llama_runs_every_tiled_call_eagerly_and_equals_the_untiled_model():
    reference, model, ids, vocab = _tiled_llama_and_ids()
    logits = reference(input_ids=ids).logits  # the untiled loss in float64 (transformers' own is float32)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    (want * 3).backward()
    out = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids)
    assert out.logits is None  # the tiled loss ran
    (out.loss * 3).backward()
    assert abs(out.loss - want).item() < BOUND
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert q.grad is not None and (q.grad - p.grad).abs().max().item() < BOUND, name
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    assert tiled and all(dynamo_support.REASON in m.tiling.compiled_reason for m in tiled)


def test_the_breaks_are_there_and_fullgraph_refuses_them():
    _, model, ids, _ = _tiled_llama_and_ids()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count > 0
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids)


def test_the_tiled_loss_alone_runs_eagerly_and_is_exact():
    torch.manual_seed(0)
    head = nn.Linear(8, 50, bias=False).double()
    reference = copy.deepcopy(head)
    hidden = torch.randn(2, 7, 8, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 7))

    def loss_fn(h, lm_head, y):
        return tiled_cross_entropy(h, lm_head, y, num_shards=3, label_smoothing=0.1)

    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    have = torch.compile(loss_fn, backend="aot_eager")(h1, head, labels)
    have.backward()
    # Position t predicts label t + 1 (the tiled loss shifts the labels as Hugging Face's causal loss does).
    want = F.cross_entropy(reference(h2)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), label_smoothing=0.1)
    want.backward()
    assert abs(have - want).item() < BOUND
    assert (h1.grad - h2.grad).abs().max().item() < BOUND
    assert (head.weight.grad - reference.weight.grad).abs().max().item() < BOUND
