"""The tiled loss runs as the forward of one call of the head (``in_head_call``, ``tiled_core/tiled_loss.py``):
the head's module hooks surround it, the head is left as it was, and hooks of the head's own that are not its
backend's are refused before any work."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tiled_mlp.core import tiled_cross_entropy
from tiled_mlp.core.tiled_loss import HEAD_HOOKS_ERROR

HIDDEN, VOCAB, TOKENS = 8, 11, 7


def _hidden_and_labels():
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
    hidden, labels = _hidden_and_labels()
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
    hidden, labels = _hidden_and_labels()
    tiled_cross_entropy(hidden, head, labels, num_shards=2)
    assert vars(head)["forward"] is own


@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook", "full_backward_hook"])
def test_a_hook_of_the_head_is_refused_before_any_work(kind):
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hook = {"forward_hook": lambda m, a, out: out * 2, "forward_pre_hook": lambda m, a: None,
            "full_backward_hook": lambda m, gi, go: None}[kind]
    getattr(head, f"register_{kind}")(hook)
    hidden, labels = _hidden_and_labels()
    prefix = HEAD_HOOKS_ERROR.split("{")[0]
    with pytest.raises(RuntimeError, match=prefix):
        tiled_cross_entropy(hidden, head, labels)
    assert hidden.grad is None and head.weight.grad is None and "forward" not in vars(head)


def _halve_in_place(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    if isinstance(module, nn.Linear):
        output.mul_(0.5)  # what a global hook can do to every Linear's output without returning it


@pytest.mark.parametrize("changes", ["returned", "in_place"])
def test_a_global_hook_that_changes_the_heads_output_is_refused_naming_it(changes):
    """A hook for every module sees the loss as the head's output (untiled: the logits); one that hands on
    another output, or changes it in place, would change the loss: refused after the call, before backward."""
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hook = _halve_in_place if changes == "in_place" else (lambda m, a, out: out * 0.5)
    hidden, labels = _hidden_and_labels()
    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        with pytest.raises(RuntimeError, match=r"register_module_forward_hook: (_halve_in_place|.*<lambda>)\) "
                                               r"changed what Linear's call returned"):
            tiled_cross_entropy(hidden, head, labels, num_shards=3)
    finally:
        handle.remove()
    assert hidden.grad is None and head.weight.grad is None and "forward" not in vars(head)


def test_under_compile_a_global_hook_registered_after_compiling_is_refused_too():
    """Compiled, a plain linear head's loss is one op that calls no module, so a hook for every module would
    never see the head's call (float64, a hook scaling every Linear's output by 1.5: 4.3063 against 4.6442
    compiled untiled); with such a hook the loss runs as the head's call, and Dynamo guards the hooks' count."""
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hidden, labels = _hidden_and_labels()
    compiled = torch.compile(lambda x: tiled_cross_entropy(x, head, labels, num_shards=3))
    reference = nn.functional.cross_entropy(head(hidden)[0, :-1], labels[0, 1:])
    torch.testing.assert_close(compiled(hidden), reference, rtol=1e-12, atol=0)
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: out * 1.5)
    try:
        with pytest.raises(RuntimeError, match="register_module_forward_hook"):
            compiled(hidden)
    finally:
        handle.remove()


def test_a_stand_in_for_the_hooks_and_the_hidden_states_for_the_loss():
    """``sees_graph=False`` (an FSDP2 unit of several modules): the head's hooks see a detached copy of the
    hidden states, the loss computes with the hidden states themselves (in the dtype the hooks gave the copy),
    and their gradient arrives."""
    from tiled_mlp.core.tiled_loss import in_head_call

    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    hidden, labels = _hidden_and_labels()
    seen = []
    head.register_forward_pre_hook(lambda m, args: seen.append(args[0]) or (args[0].float(),))
    got = in_head_call(head, hidden, lambda x: (x.dtype, x.sum()), sees_graph=False)
    assert not seen[0].requires_grad and seen[0].grad_fn is None and torch.equal(seen[0], hidden)
    dtype, total = got
    assert dtype == torch.float32 and total.requires_grad
    total.backward()
    torch.testing.assert_close(hidden.grad, torch.ones_like(hidden))
    got = in_head_call(head, hidden, lambda x: x, sees_graph=True)  # the default: the hooks' own input
    assert got.dtype == torch.float32 and seen[1] is hidden
