"""``torch.compile`` over the core: the tiled loss (a function or a module) and a block holding a tiled MLP
(fast and generic path) compile without error and equal the eager untiled computation in float64:
the loss or output, the input gradient and every parameter gradient.

``backend="aot_eager"`` traces exactly what inductor would be given (Dynamo, then AOT autograd's forward
and backward graphs) without generating code, which takes minutes on two cores. Graph breaks are allowed
(the tiled MLP's forward is a ``torch.compiler.disable`` frame); these tests hold the results, not the
graph count.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from loss_reference import ScaledLoRAHead
from reference import GatedMLP
from torch import nn

from tiled_mlp.core import TiledCrossEntropy, TiledMLP, tiled_cross_entropy

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_dynamo")]

HIDDEN, VOCAB = 8, 13
BOUND = 1e-12  # float64: the tiled loss sums shards in another order than the untiled one


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 7, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 7), generator=generator)
    labels[0, :2] = -100
    return hidden, labels


def _untiled_loss(hidden, head, labels, reduction="mean"):
    logits = head(hidden)[:, :-1].reshape(-1, VOCAB)
    return F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction=reduction)


def _loss_run(loss_fn, hidden, head, labels):
    """(loss, d hidden, every parameter's gradient) of ``3 * loss`` (a gradient other than 1 reaches the loss)."""
    head = copy.deepcopy(head)
    hidden = hidden.clone().requires_grad_()
    loss = loss_fn(hidden, head, labels)
    (loss * 3.0).backward()
    return [loss.detach(), hidden.grad, *(p.grad for p in head.parameters())]


def _assert_close(want, have):
    assert len(want) == len(have)
    for a, b in zip(want, have, strict=True):
        assert b is not None and (a - b).abs().max().item() < BOUND


HEADS = {
    "linear": lambda: nn.Linear(HIDDEN, VOCAB, bias=False).double(),
    "linear-bias": lambda: nn.Linear(HIDDEN, VOCAB).double(),
    "module": lambda: ScaledLoRAHead(HIDDEN, VOCAB).double(),
}


# The module head traces its forward under autograd inside the Function (15-30 s a case on two cores): one case.
CASES = [("linear", 1, "mean"), ("linear", 3, "mean"), ("linear", 3, "sum"), ("linear-bias", 3, "mean"),
         ("module", 3, "mean")]


@pytest.mark.parametrize("head_name,num_shards,reduction", CASES)
def test_compiled_tiled_loss_function_equals_eager_untiled(head_name, num_shards, reduction):
    torch.manual_seed(0)
    head = HEADS[head_name]()
    hidden, labels = _inputs()

    def loss_fn(h, lm_head, y):
        return tiled_cross_entropy(h, lm_head, y, num_shards=num_shards, reduction=reduction)

    want = _loss_run(lambda h, m, y: _untiled_loss(h, m, y, reduction), hidden, head, labels)
    have = _loss_run(torch.compile(loss_fn, backend="aot_eager"), hidden, head, labels)
    _assert_close(want, have)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_double_backward_through_the_compiled_tiled_loss_is_refused(backend):
    # The loss's gradients are formed in forward: a second-order term through them would be zero. backend
    # "eager" runs the op's registered backward itself (the loss's own refusal); AOT autograd refuses double
    # backward through a graph whose backward reads a tensor that requires grad (the head's weight).
    head = HEADS["linear"]()
    hidden, labels = _inputs()
    h = hidden.clone().requires_grad_()
    loss = torch.compile(lambda x: tiled_cross_entropy(x, head, labels, num_shards=3), backend=backend)(h)
    with pytest.raises(RuntimeError, match="double backward"):
        (dh,) = torch.autograd.grad(loss, h, create_graph=True)
        torch.autograd.grad(dh.pow(2).sum(), [h, head.weight], allow_unused=True)


def test_an_input_the_eager_call_refuses_is_refused_compiled():
    # A 1-D input: the op would flatten it into one token; the eager call refuses it before any work.
    tiled = TiledMLP(GatedMLP(HIDDEN, 20).double(), num_shards=2)
    with pytest.raises(ValueError, match="2 dims or more"):
        torch.compile(tiled, backend="aot_eager")(torch.randn(HIDDEN, dtype=torch.float64))


class _HeadWithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.loss = TiledCrossEntropy(num_shards=2)

    def forward(self, hidden, labels):
        return self.loss(hidden, self.lm_head, labels)


def test_compiled_module_with_tiled_loss_equals_eager_untiled():
    torch.manual_seed(0)
    model = _HeadWithLoss().double()
    hidden, labels = _inputs()
    compiled = torch.compile(model, backend="aot_eager")
    want = _loss_run(lambda h, m, y: _untiled_loss(h, m.lm_head, y), hidden, model, labels)
    # The compiled module shares its parameters with ``model``: read the gradients from ``model``.
    model.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_()
    loss = compiled(h, labels)
    (loss * 3.0).backward()
    _assert_close(want, [loss.detach(), h.grad, *(p.grad for p in model.parameters())])


class _NormResidual(nn.Module):
    """A residual block around an MLP, so that the compiled region holds more than the tiled call."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x)) * 0.5


@pytest.mark.parametrize("path,tied", [("fast", False), ("generic", False), ("fast", True)])
def test_compiled_block_with_tiled_mlp_equals_eager_untiled(path, tied):
    # tied: gate and up share one weight, which the op takes once and both roles' gradients are summed into.
    torch.manual_seed(0)
    plain = _NormResidual(GatedMLP(HIDDEN, 20)).double()
    if tied:
        plain.mlp.up_proj.weight = plain.mlp.gate_proj.weight
    tiled = copy.deepcopy(plain)
    TiledMLP(tiled.mlp, num_shards=3, path=path)
    x = torch.randn(2, 9, HIDDEN, dtype=torch.float64)
    dy = torch.randn(2, 9, HIDDEN, dtype=torch.float64)

    def run(module, call):
        xi = x.clone().requires_grad_()
        y = call(xi)
        y.backward(dy)
        return [y.detach(), xi.grad, *(p.grad for p in module.parameters())]

    want = run(plain, plain)
    have = run(tiled, torch.compile(tiled, backend="aot_eager"))
    assert tiled.mlp.tiling.last_path == path and tiled.mlp.tiling.last_num_shards == 3
    _assert_close(want, have)
