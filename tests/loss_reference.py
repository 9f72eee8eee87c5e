"""Heads, inputs and the untiled references that the tiled loss's tests compare against.

The reference is Hugging Face's own ``ForCausalLMLoss`` on ``lm_head(hidden)``, in float64: its
``logits.float()`` would round float64 logits to float32, so ``Tensor.float`` is patched to the identity
around that one call (the reference only; the tiled call never runs under the patch). ``hf_loss(..., downcast=True)`` is the unpatched loss.
``hf_label_smoother`` is the Trainer's
``LabelSmoother``, kept in float64 the same way. Options that
Hugging Face leaves to the model are written out here from their definitions (``option_reference``).

Every run deep-copies the head and takes a fresh leaf copy of the hidden states, so a reference run and
a tiled run never share a ``.grad``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Dict, Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HIDDEN, VOCAB = 16, 50


class ScaledLoRAHead(nn.Module):
    """A head that is not a plain ``nn.Linear`` (``base(x) + b(a(x)) * 0.5``): the generic
    ``ModuleHeadKernel`` path. It has no ``weight``/``out_features`` of its own, on purpose."""

    def __init__(self, hidden: int, vocab: int, rank: int = 3):
        super().__init__()
        self.base = nn.Linear(hidden, vocab)
        self.a = nn.Linear(hidden, rank, bias=False)
        self.b = nn.Linear(rank, vocab, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x)) * 0.5


def linear_head(seed: int = 0, bias: bool = False, hidden: int = HIDDEN, vocab: int = VOCAB,
                dtype: torch.dtype = torch.float64) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(hidden, vocab, bias=bias).to(dtype)


def module_head(seed: int = 0, hidden: int = HIDDEN, vocab: int = VOCAB) -> ScaledLoRAHead:
    torch.manual_seed(seed)
    return ScaledLoRAHead(hidden, vocab).double()


def hidden_batch(shape=(2, 9), seed: int = 1, hidden: int = HIDDEN, vocab: int = VOCAB, ignored: int = 2,
          dtype: torch.dtype = torch.float64):
    """Random hidden states ``[*shape, hidden]`` and labels ``[*shape]``; the first ``ignored``
    positions of the first row are -100, so rows have different numbers of valid tokens (the mean is
    over valid tokens, not positions)."""
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(*shape, hidden, generator=generator, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels.view(-1, shape[-1])[0, :ignored] = -100
    return hidden_states, labels


def shifted(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's shift: position t predicts label t + 1, the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def hf_loss(logits: torch.Tensor, labels: Optional[torch.Tensor] = None, *, downcast: bool = False,
            **kwargs) -> torch.Tensor:
    """``ForCausalLMLoss`` without its float32 downcast (float64 logits stay float64), or as it is with
    ``downcast=True``. A test that needs it skips where transformers is not installed (``tox -e core``);
    the others still run there."""
    ForCausalLMLoss = pytest.importorskip("transformers.loss.loss_utils").ForCausalLMLoss
    if downcast:
        return ForCausalLMLoss(logits, labels, logits.shape[-1], **kwargs)
    with mock.patch.object(torch.Tensor, "float", lambda self: self):
        return ForCausalLMLoss(logits, labels, logits.shape[-1], **kwargs)


def hf_label_smoother(logits: torch.Tensor, labels: torch.Tensor, epsilon: float, *, ignore_index: int = -100,
                      num_items_in_batch=None, downcast: bool = False) -> torch.Tensor:
    """transformers' ``LabelSmoother`` as the Trainer calls it on a causal LM (``shift_labels=True``). It sums
    its smoothing term with ``dtype=torch.float32`` whatever the logits' dtype: patched to float64 around
    that one call (``torch.float32`` is read at the call), or as it is with ``downcast=True``."""
    LabelSmoother = pytest.importorskip("transformers.trainer_pt_utils").LabelSmoother
    smoother = LabelSmoother(epsilon=epsilon, ignore_index=ignore_index)
    if downcast:
        return smoother({"logits": logits}, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)
    with mock.patch.object(torch, "float32", torch.float64):
        return smoother({"logits": logits}, labels, shift_labels=True, num_items_in_batch=num_items_in_batch)


def option_reference(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                     label_smoothing: float = 0.0, logit_softcap: Optional[float] = None,
                     z_loss: float = 0.0) -> torch.Tensor:
    """The options' definitions, untiled, mean over valid tokens: Gemma 2's soft-capping, then
    ``F.cross_entropy`` with its label smoothing, plus ``z_loss * logsumexp(logits) ** 2`` averaged over
    the same valid tokens (the same denominator)."""
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    flat = logits.reshape(-1, logits.shape[-1])
    targets = shifted(labels, ignore_index).reshape(-1)
    loss = F.cross_entropy(flat, targets, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if z_loss:
        valid = targets != ignore_index
        loss = loss + z_loss * torch.logsumexp(flat[valid], dim=-1).square().sum() / valid.sum()
    return loss


def single_thread():
    """For a module-scoped autouse fixture: one intra-op thread. These tensors are tiny; more threads only
    add synchronisation, and oversubscribe the cores under xdist (-n 2 on 2 cores: 4 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class LossRun:
    """What one forward+backward produced: the loss, the hidden states' gradient, every head gradient."""

    loss: torch.Tensor
    dx: Optional[torch.Tensor]
    grads: Dict[str, Optional[torch.Tensor]]


def loss_run(loss_fn: Callable[[torch.Tensor, nn.Module], torch.Tensor], hidden: torch.Tensor, head: nn.Module,
        grad_scale: float = 1.0, hidden_grad: bool = True) -> LossRun:
    """``(loss_fn(hidden, head) * grad_scale).backward()`` on copies; what it left in ``.grad``."""
    head = copy.deepcopy(head)
    x = hidden.detach().clone().requires_grad_(hidden_grad)
    loss = loss_fn(x, head)
    (loss * grad_scale).backward()
    return LossRun(loss.detach(), x.grad, {n: None if p.grad is None else p.grad.clone() for n, p in head.named_parameters()})


def max_abs_diff(want: torch.Tensor, have: torch.Tensor) -> float:
    assert want.shape == have.shape, f"shape {tuple(have.shape)} != {tuple(want.shape)}"
    return float((have.double() - want.double()).abs().max()) if want.numel() else 0.0


def assert_same_run(want: LossRun, have: LossRun, atol: float = 1e-12) -> None:
    """Loss, input gradient and every parameter gradient within ``atol`` (absolute), same presence."""
    assert have.loss.dtype == want.loss.dtype, (have.loss.dtype, want.loss.dtype)
    errors = {"loss": max_abs_diff(want.loss, have.loss)}
    assert (want.dx is None) == (have.dx is None), f"dx presence: reference {want.dx is not None}, tiled {have.dx is not None}"
    if want.dx is not None:
        errors["dx"] = max_abs_diff(want.dx, have.dx)
    assert want.grads.keys() == have.grads.keys()
    for name, ref in want.grads.items():
        got = have.grads[name]
        assert (ref is None) == (got is None), f"{name}: grad presence: reference {ref is not None}, tiled {got is not None}"
        if ref is not None:
            errors[name] = max_abs_diff(ref, got)
    bad = {k: v for k, v in errors.items() if not v <= atol}  # `not <=` also catches NaN
    assert not bad, f"max abs differences above {atol:g}: {bad}"


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produced (by element count) and the op that produced it."""

    def __init__(self):
        super().__init__()
        self.numel, self.op, self.shape = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op, self.shape = t.numel(), func, tuple(t.shape)
        return out


class OpLog(TorchDispatchMode):
    """The names of the ops dispatched inside it: shows that a refused call did no work."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
