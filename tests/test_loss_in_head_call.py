"""The tiled loss runs as the forward of one call of the head (``tiled_core/head_call.py``): the head's
module hooks surround it, the head is left as it was, and hooks of the head's own that are not its
backend's are refused before any work."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tiled_mlp.core import tiled_cross_entropy
from tiled_mlp.core.tiled_loss import HEAD_HOOKS_ERROR

HIDDEN, VOCAB, TOKENS = 8, 11, 7


def _inputs():
    torch.manual_seed(0)
    hidden = torch.randn(1, TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, TOKENS))
    return hidden, labels


class _ScaledHead(nn.Module):
    """A head that is not a plain Linear: the module kernel calls its forward per shard."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)

    def forward(self, x):
        return self.proj(x) * 0.5


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_the_loss_runs_inside_one_call_of_the_head_which_is_left_as_it_was(head_kind):
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64) if head_kind == "linear" else _ScaledHead()
    calls = []
    hidden, labels = _inputs()
    # A hook that only reads: installed once to see the call, then taken off (a hook is refused).
    seen = nn.modules.module.register_module_forward_hook(lambda m, a, out: calls.append((m, out)) if m is head else None)
    try:
        loss = tiled_cross_entropy(hidden, head, labels, num_shards=3)
    finally:
        seen.remove()
    assert len(calls) == 1 and calls[0][1] is loss  # one call of the head, whose output is the loss
    assert "forward" not in vars(head)  # the forward for that call took itself off
    loss.backward()
    reference = nn.functional.cross_entropy(head(hidden.detach())[0, :-1], labels[0, 1:])
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=0)


def test_an_instance_forward_of_the_head_is_put_back():
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    own = head.forward  # a bound method put on the instance (as accelerate's device hooks do)
    head.forward = own
    hidden, labels = _inputs()
    tiled_cross_entropy(hidden, head, labels, num_shards=2)
    assert vars(head)["forward"] is own


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook"])
def test_a_hook_of_the_head_is_refused_before_any_work(kind):
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hook = {"forward_hook": lambda m, a, out: out * 2, "forward_pre_hook": lambda m, a: None,
            "full_backward_hook": lambda m, gi, go: None}[kind]
    getattr(head, f"register_{kind}")(hook)
    hidden, labels = _inputs()
    prefix = HEAD_HOOKS_ERROR.split("{")[0]
    with pytest.raises(RuntimeError, match=prefix):
        tiled_cross_entropy(hidden, head, labels)
    assert hidden.grad is None and head.weight.grad is None and "forward" not in vars(head)
