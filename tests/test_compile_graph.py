"""torch.compile traces the tiled MLP's fast path, the tiled norms and the tiled loss with no graph break:
``torch._dynamo.explain`` finds one graph for a tiny Llama with tiled MLPs, norms and the tiled loss, and
``torch.compile(fullgraph=True)`` (which raises at any break) gives, in float64, the untiled model's loss
and every gradient. Calls that cannot be one op run eagerly behind one break, and say why. Every test runs
with the routes' decisions given objects and given ids (the ``passing`` fixture).

``aot_eager`` traces what inductor is given (Dynamo, then AOT autograd's graphs) without generating code.
The untiled reference computes its loss from its logits in float64: transformers' own loss upcasts logits
with ``.float()``, which is float32 even for a float64 model, while the tiled loss computes in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import GatedMLP
from torch import nn

from integration_tests.dynamo_versions import traced_as_ops

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model  # noqa: E402
from tiled_mlp import TiledMLP, apply_tiled_mlp, tiled_cross_entropy  # noqa: E402
from tiled_mlp.core import dynamo_support  # noqa: E402

pytestmark = [pytest.mark.timeout(60), traced_as_ops, pytest.mark.usefixtures("fresh_dynamo", "passing")]

BOUND = 1e-12  # float64: tiled sums run over shards in another order than the untiled ones


@pytest.fixture(params=["objects", "ids"])
def passing(request, monkeypatch):
    """Each test twice: the routes' decisions given the objects themselves (torch >= 2.12) and given their
    ids (how every older release traces them, ``dynamo_support``), which any release can run."""
    if request.param == "objects" and not dynamo_support.PASSES_OBJECTS:
        pytest.skip(f"torch {torch.__version__} cannot pass an object to assume_constant_result")
    monkeypatch.setattr(dynamo_support, "PASSES_OBJECTS", request.param == "objects")


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 13), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _tiled_llama():
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    apply_tiled_mlp(model, num_shards=2, loss=True, loss_num_shards=3, norms=True)
    return reference, model


def _reference_step(model, ids, labels):
    """The untiled model's loss (from its logits, in float64) times 3, and every gradient."""
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    (loss * 3).backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _compiled_step(model, ids, labels, **compile_kwargs):
    out = torch.compile(model, backend="aot_eager", **compile_kwargs)(input_ids=ids, labels=labels)
    assert out.logits is None  # the tiled loss ran
    (out.loss * 3).backward()
    return out.loss.detach(), [p.grad for p in model.parameters()]


def test_tiny_llama_with_tiled_mlps_norms_and_loss_traces_as_one_graph():
    _, model = _tiled_llama()
    ids, labels = _batch()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    ops = sorted({m.tiling.compiled_reason.split("tiled_mlp::")[1].rstrip(")") for m in tiled})
    assert ops == ["gated_mlp", "rms_norm"], [m.tiling.compiled_reason for m in tiled]


def test_fullgraph_compile_equals_the_untiled_model_in_float64():
    reference, model = _tiled_llama()
    ids, labels = _batch()
    want_loss, want_grads = _reference_step(reference, ids, labels)
    have_loss, have_grads = _compiled_step(model, ids, labels, fullgraph=True)
    assert abs(have_loss - want_loss).item() < BOUND
    for (name, _), want, have in zip(reference.named_parameters(), want_grads, have_grads, strict=True):
        assert have is not None and (have - want).abs().max().item() < BOUND, name


class _WorkAroundMLP(nn.Module):
    """Work on both sides of the MLP, so that a break inside the MLP's call shows as two graphs."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = GatedMLP(8, 20)

    def forward(self, x):
        return (x + self.mlp(self.norm(x))).relu()


def test_a_generic_mlp_runs_eagerly_behind_one_break_and_says_why():
    torch.manual_seed(0)
    block = _WorkAroundMLP().double()
    reference = copy.deepcopy(block)
    TiledMLP(block.mlp, num_shards=3, path="generic")
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 1
    assert "the generic kernel runs the call" in block.mlp.tiling.compiled_reason
    torch._dynamo.reset()
    have = torch.compile(block, backend="aot_eager")(x)
    assert (have - reference(x)).abs().max().item() < BOUND


def test_a_short_call_the_policy_passes_through_is_traced_as_the_module_itself():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    reference = copy.deepcopy(mlp)
    TiledMLP(mlp)  # auto: 9 tokens are far too few to tile
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    explained = torch._dynamo.explain(mlp)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert "traced as the module's own forward" in mlp.tiling.compiled_reason
    assert mlp.tiling.last_path == "untiled"
    torch._dynamo.reset()
    assert (torch.compile(mlp, backend="aot_eager", fullgraph=True)(x) - reference(x)).abs().max().item() == 0


def test_a_forward_patched_after_compiling_is_traced_again():
    """The compiled graph rests on the class's forward: Dynamo guards on it, so a patched forward traces the
    call again, and the new route runs what the new forward computes."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    compiled = torch.compile(mlp, backend="aot_eager")
    compiled(x)
    assert mlp.tiling.last_path == "fast"
    original = GatedMLP.forward
    try:
        GatedMLP.forward = lambda self, h: self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h)) * 2.0
        have = compiled(x)
        want = 2.0 * original(mlp, x)
    finally:
        GatedMLP.forward = original
    assert "generic" in mlp.tiling.compiled_reason
    assert (have - want).abs().max().item() < BOUND


def test_symbolic_sizes_stay_exact():
    """Each size is specialized where the route is decided and the call traced again for it
    (``tests/test_compile_by_identity.py`` checks the decision sees plain ints; ``tests/test_compile_lengths.py``
    a whole model under ``fullgraph=True``)."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    reference = copy.deepcopy(mlp)
    TiledMLP(mlp, num_shards=2)
    compiled = torch.compile(mlp, backend="aot_eager", dynamic=True)
    for tokens in (9, 11):
        x = torch.randn(1, tokens, 8, dtype=torch.float64)
        assert (compiled(x) - reference(x)).abs().max().item() < BOUND


HEADS = {"linear": lambda: nn.Linear(8, VOCAB, bias=False), "linear-bias": lambda: nn.Linear(8, VOCAB)}


@pytest.mark.parametrize("head_name", sorted(HEADS))
def test_tiled_loss_alone_traces_as_one_graph_and_is_exact(head_name):
    torch.manual_seed(0)
    head = HEADS[head_name]().double()
    reference = copy.deepcopy(head)
    hidden = torch.randn(2, 7, 8, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 7))
    labels[1, 2:4] = -100

    def loss_fn(h, lm_head, y):
        return tiled_cross_entropy(h, lm_head, y, num_shards=3, logit_softcap=5.0, label_smoothing=0.1, z_loss=1e-3)

    explained = torch._dynamo.explain(loss_fn)(hidden, head, labels)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    have = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)(h1, head, labels)
    (have * 3).backward()
    # The eager tiled loss in one shard: the reference for the options F.cross_entropy lacks (soft-capping, z-loss).
    want = tiled_cross_entropy(h2, reference, labels, num_shards=1, logit_softcap=5.0, label_smoothing=0.1, z_loss=1e-3)
    (want * 3).backward()
    assert abs(have - want).item() < BOUND
    for a, b in zip([h1.grad, *head.parameters()], [h2.grad, *reference.parameters()], strict=True):
        a = a if not isinstance(a, nn.Parameter) else a.grad
        b = b if not isinstance(b, nn.Parameter) else b.grad
        assert (a - b).abs().max().item() < BOUND


def test_labels_outside_the_vocabulary_are_refused_by_the_op_at_every_call():
    head = nn.Linear(8, VOCAB).double()
    compiled = torch.compile(lambda h, y: tiled_cross_entropy(h, head, y, num_shards=2), backend="aot_eager")
    hidden = torch.randn(1, 5, 8, dtype=torch.float64)
    compiled(hidden, torch.zeros(1, 5, dtype=torch.long))
    bad = torch.zeros(1, 5, dtype=torch.long)
    bad[0, 3] = VOCAB
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compiled(hidden, bad)


def test_double_backward_through_the_op_is_refused():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, 9, 8, dtype=torch.float64, requires_grad=True)
    y = torch.compile(mlp, backend="aot_eager")(x)
    (grad,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_an_instance_forward_or_a_changed_setting_traces_the_call_again():
    """What the route rests on is guarded: an instance forward, then another shard count and path, each take
    effect at the next compiled call."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    compiled = torch.compile(mlp, backend="aot_eager")
    want = compiled(x)
    assert mlp.tiling.last_path == "fast"
    mlp.forward = lambda h: GatedMLP.forward(mlp, h) * 0.5
    assert (compiled(x) - 0.5 * want).abs().max().item() < BOUND
    assert "an instance forward is installed" in mlp.tiling.compiled_reason
    del mlp.forward
    mlp.tiling.num_shards, mlp.tiling.path = 3, "generic"
    assert (compiled(x) - want).abs().max().item() < BOUND
    assert (mlp.tiling.last_path, mlp.tiling.last_num_shards) == ("generic", 3)


def test_a_forward_bound_into_the_instance_dict_before_compiling_runs_eagerly():
    """Liger binds a forward by writing the instance's dict: the eager call adopts it, so the route does not take
    the op."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 20).double()
    TiledMLP(mlp, num_shards=2)
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    mlp.__dict__["forward"] = lambda h: GatedMLP.forward(mlp, h) * 0.5
    want = 0.5 * GatedMLP.forward(mlp, x)
    assert (torch.compile(mlp, backend="aot_eager")(x) - want).abs().max().item() < BOUND
    assert "an instance forward is installed" in mlp.tiling.compiled_reason


def test_a_failed_call_keeps_no_hidden_states():
    _, model = _tiled_llama()
    ids, labels = _batch()

    def fail(_module, _args, _out):
        raise RuntimeError("boom")

    handle = model.get_decoder().register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, labels=labels)
    handle.remove()
    forward = vars(model)["forward"]
    assert forward._captured is None and not forward._capturing
    copy.deepcopy(model)  # a kept graph tensor would refuse the deep copy
