"""The routes' decisions given objects by their ids (``tiled_mlp.core.dynamo_support``): how every torch before
2.12 traces them, forced here on any torch. A tiny Llama with everything tiled compiles as one graph and
equals the untiled model; each decision sees the very object its call traced, is traced again for another
object, and is not for the same one.

``tests/test_compile_graph.py`` runs all its cases both ways (its ``passing`` fixture).
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from integration_tests.dynamo_versions import traced_as_ops
from tiled_mlp import TiledMLP
from tiled_mlp.core import dynamo_support

pytestmark = [pytest.mark.timeout(60), traced_as_ops, pytest.mark.usefixtures("fresh_dynamo")]

BOUND = 1e-12  # float64


@pytest.fixture
def resolved(monkeypatch):
    """The id path forced, and every object it turns back from an id, in order."""
    monkeypatch.setattr(dynamo_support, "PASSES_OBJECTS", False)
    seen = []
    object_at = dynamo_support._object_at

    def spy(address):
        seen.append(object_at(address))
        return seen[-1]

    monkeypatch.setattr(dynamo_support, "_object_at", spy)
    return seen


def test_a_tiny_llama_traces_as_one_graph_by_ids_and_equals_the_untiled_model(resolved):
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import VOCAB, tiny_model
    from tiled_mlp import apply_tiled_mlp

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_tiled_mlp(model, num_shards=2, loss=True, loss_num_shards=3, norms=True)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    # Every tiled module, the tiled loss's forward and the head were handed over by id.
    assert {id(m) for m in tiled} <= {id(o) for o in resolved}
    assert any(o is model.get_output_embeddings() for o in resolved)
    torch._dynamo.reset()

    logits = reference(input_ids=ids).logits  # the untiled loss in float64 (transformers' own is float32)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    (want * 3).backward()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(input_ids=ids, labels=ids)
    assert out.logits is None  # the tiled loss ran
    (out.loss * 3).backward()
    assert abs(out.loss - want).item() < BOUND
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert q.grad is not None and (q.grad - p.grad).abs().max().item() < BOUND, name


class _Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * _scale_of(self, x.shape)


_decided = []


@dynamo_support.decided_where_traced
def _scale_of(module: _Scaled, shape: tuple) -> float:
    _decided.append((module, shape))
    return module.scale


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = _Scaled(2.0), _Scaled(5.0)

    def forward(self, x):
        return self.second(self.first(x))


def test_each_decision_sees_its_own_object_and_is_traced_again_only_for_another(resolved):
    _decided.clear()
    pair = _Pair()
    compiled = torch.compile(pair, backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 10)
    assert {id(m) for m, _ in _decided} == {id(pair.first), id(pair.second)}
    assert len(resolved) == len(_decided) and all(m is o for (m, _), o in zip(_decided, resolved, strict=True))
    count = len(_decided)
    assert torch.equal(compiled(x), x * 10)
    assert len(_decided) == count  # the same objects: the graph's constants serve
    pair.first = _Scaled(7.0)  # another object, the same class and attributes but its scale
    assert torch.equal(compiled(x), x * 35)
    assert any(m is pair.first for m, _ in _decided[count:])


def test_a_symbolic_size_is_specialized_for_the_decision(resolved):
    _decided.clear()
    module = _Scaled(3.0)
    compiled = torch.compile(module, backend="eager", dynamic=True)
    for n in (5, 7):
        assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 3.0))
    shapes = {shape for _, shape in _decided}
    assert shapes == {(5,), (7,)} and all(type(n) is int for shape in shapes for n in shape)


def test_outside_a_trace_the_decision_is_a_plain_call(resolved):
    _decided.clear()
    module = _Scaled(4.0)
    assert _scale_of(module, (2,)) == 4.0
    assert _decided == [(module, (2,))] and resolved == []


def test_an_object_not_of_the_class_the_trace_saw_is_refused(resolved, monkeypatch):
    monkeypatch.setattr(dynamo_support, "_object_at", lambda address: object())
    with pytest.raises(Exception, match="cannot be decided where traced"):
        torch.compile(_Scaled(2.0), backend="eager", fullgraph=True)(torch.ones(3))


def test_a_forward_read_eagerly_under_an_active_compile_is_the_method():
    """Dynamo compiles the frames a skipped frame calls: ``bound`` and ``TiledForward.__get__`` must still
    give the method there (a partial only where Dynamo traces the read)."""
    from reference import GatedMLP

    mlp = GatedMLP(8, 20).double()
    TiledMLP(mlp, num_shards=2)
    seen = []

    @torch.compiler.disable(recursive=False)
    def eager_part(y):
        seen.append(type(mlp.forward))
        return mlp.forward(y)

    def f(x):
        return eager_part(x * 2)

    x = torch.randn(1, 5, 8, dtype=torch.float64)
    assert torch.equal(torch.compile(f, backend="eager")(x), mlp(x * 2))
    assert seen == [types.MethodType]
