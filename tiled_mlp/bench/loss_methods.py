"""The causal-LM loss computations ``tiled-mlp bench-loss`` compares, and the inputs they share.

Each method is ``make(head) -> step(hidden, labels) -> loss``: ``head`` an ``nn.Linear(hidden, vocab,
bias=False)``, ``hidden`` ``[1, tokens, hidden]``, ``labels`` ``[1, tokens]`` unshifted, as a model hands
them to its loss. The loss is the mean over valid tokens, Hugging Face's ``ForCausalLMLoss``; backward of it
gives dx and dW.

- ``untiled``: Hugging Face's way, ``logits = hidden @ W.T`` in the weight dtype, then ``ForCausalLMLoss``
  (which upcasts the logits to float32).
- ``torch``: torch's chunked ``F.linear_cross_entropy`` with default ``LinearCrossEntropyOptions()``.
- ``deepspeed``: DeepSpeed's ``TiledFusedLogitsLoss`` called as ArcticTraining's SFT trainer calls it
  (per shard ``mean * valid tokens``, reduction "sum", then divided by the valid-token count N).
- ``ours`` / ``ours_fp32``: ``tiled_cross_entropy`` with ``num_shards="auto"``, head-dtype or float32
  gradient accumulation.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from tiled_mlp.core import tiled_cross_entropy
from tiled_mlp.core.loss_shards import loss_num_shards

IGNORE_INDEX = -100
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted as ForCausalLMLoss shifts them: position t predicts label t + 1, the last ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], vocab: int,
                   shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss``; without transformers, the same steps written out."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        if shift_labels is None:
            assert labels is not None, "labels or shift_labels"
            shift_labels = shifted(labels)
        return F.cross_entropy(logits.float().view(-1, vocab), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX)
    return ForCausalLMLoss(logits, labels, vocab, shift_labels=shift_labels)


def _untiled(head: nn.Linear) -> Step:
    return lambda hidden, labels: causal_lm_loss(hidden @ head.weight.t(), labels, head.out_features)


def _torch_chunked(head: nn.Linear) -> Step:
    options = torch.nn.LinearCrossEntropyOptions()
    # It takes [N, hidden] rows and pre-shifted targets (its own ignore_index, -100).
    return lambda hidden, labels: F.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted(labels).reshape(-1),
        ignore_index=IGNORE_INDEX, options=options)


def arctic_num_shards(tokens: int, vocab: int) -> int:
    """ArcticTraining's "auto" shard count for TiledFusedLogitsLoss: about 1 GiB of float32 logits a shard."""
    return max(1, math.ceil(tokens * vocab * 4 / 2**30))


class _ModelWithHead(nn.Module):
    """What ArcticTraining passes as TiledFusedLogitsLoss's ``self``: the model, reached for its lm_head."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.lm_head = head


def deepspeed_unavailable() -> Optional[str]:
    """Why the DeepSpeed row cannot run here, or None when it can."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'tiled-mlp[deepspeed]')"
    try:
        _tiled_fused_logits_loss()
    except Exception as error:  # any import-time failure of deepspeed skips the row, with its reason
        return f"deepspeed cannot be imported: {type(error).__name__}: {error}"
    return None


def _tiled_fused_logits_loss():
    # DeepSpeed logs its accelerator detection to stdout on import, which would corrupt --json.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    return TiledFusedLogitsLoss


def _deepspeed_arctic(head: nn.Linear, num_shards: Optional[int] = None) -> Step:
    fused = _tiled_fused_logits_loss()
    vocab = head.out_features
    model = _ModelWithHead(head)

    def shard_loss_sum(model_with_head, hidden, shift_labels):
        # ArcticTraining's per-shard function: the shard's mean loss times its valid tokens (a sum).
        # Its guard for a shard with no valid label is left out: the bench's labels never make one.
        logits = model_with_head.lm_head(hidden)
        good = (shift_labels != IGNORE_INDEX).sum()
        return causal_lm_loss(logits, None, vocab, shift_labels=shift_labels) * good

    def step(hidden, labels):
        targets = shifted(labels)
        shards = num_shards or arctic_num_shards(targets.numel(), vocab)
        total = fused.apply(shard_loss_sum, model, hidden, targets, None, shards, [head.weight], "sum")
        # ArcticTraining's ``max(total_good_items, 1)``, without reading the count on the host.
        return total / (targets != IGNORE_INDEX).sum().clamp_min(1)

    return step


def _ours(grad_accum_dtype: Optional[torch.dtype]) -> Callable[[nn.Linear], Step]:
    def make(head: nn.Linear) -> Step:
        return lambda hidden, labels: tiled_cross_entropy(hidden, head, labels, num_shards="auto",
                                                          grad_accum_dtype=grad_accum_dtype)
    return make


@dataclass(frozen=True)
class LossMethod:
    label: str
    make: Callable[..., Step]


METHODS: Dict[str, LossMethod] = {
    "untiled": LossMethod("untiled (HF ForCausalLMLoss)", _untiled),
    "torch": LossMethod("torch chunked F.linear_cross_entropy", _torch_chunked),
    "deepspeed": LossMethod("DeepSpeed TiledFusedLogitsLoss (ArcticTraining: sum / N)", _deepspeed_arctic),
    "ours": LossMethod("ours tiled_cross_entropy (head-dtype accum)", _ours(None)),
    "ours_fp32": LossMethod("ours tiled_cross_entropy (fp32 accum)", _ours(torch.float32)),
}


def available_methods() -> Tuple[Dict[str, LossMethod], Dict[str, str]]:
    """(the methods that can run here, {skipped method: why})."""
    skipped = {}
    reason = deepspeed_unavailable()
    if reason is not None:
        skipped["deepspeed"] = reason
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        skipped["torch"] = f"torch {torch.__version__} has no F.linear_cross_entropy (added in torch 2.13)"
    return {k: m for k, m in METHODS.items() if k not in skipped}, skipped


def shard_count(method: str, tokens: int, hidden: int, vocab: int, dtype: torch.dtype,
                deepspeed_shards: Optional[int] = None) -> int:
    """How many token chunks ``method`` runs in at this size (for the table)."""
    if method == "untiled":
        return 1
    if method == "deepspeed":
        return deepspeed_shards or arctic_num_shards(tokens, vocab)
    if method == "torch":
        # The chunk size torch resolves per (device, dtype); the resolver is private, so only for display.
        options = torch.nn.LinearCrossEntropyOptions()._adjust(tokens, hidden, vocab, dtype, torch.device("cpu"))
        return math.ceil(tokens / options.batch_chunk_size)
    return loss_num_shards(tokens, vocab)


def make_case(tokens: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """(head, hidden states requiring grad, labels) with real values, on ``device`` (drawn on the CPU: the
    same values everywhere); every 10th label ignored, so the valid-token count N differs from the token
    count (as padding and prompt masking make it)."""
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator) / math.sqrt(hidden))
    x = torch.randn(1, tokens, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    labels[:, ::10] = IGNORE_INDEX
    return head, x, labels.to(device)


def run_step(step: Step, head: nn.Linear, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One forward+backward from cleared gradients; the loss, detached."""
    head.zero_grad(set_to_none=True)
    x.grad = None
    loss = step(x, labels)
    loss.backward()
    return loss.detach()
