"""Cross-entropy of one shard of logits, and its gradient, in place in one buffer.

Per valid token i (``target_i != ignore_index``), with ``z = c * tanh(l / c)`` under soft-capping
(Gemma 2's ``final_logit_softcapping``) and ``z = l`` otherwise, ``lse_i = logsumexp(z_i)``:

    loss_i = (1 - eps) * (lse_i - z_i[t_i])        negative log-likelihood
           + eps * (lse_i - mean_j z_ij)            label smoothing, as ``F.cross_entropy``'s
           + lam * lse_i ** 2                       z-loss (PaLM)

    dloss_i/dz_i = (1 + 2 lam lse_i) softmax(z_i) - (1 - eps) onehot(t_i) - eps / V
    dloss_i/dl_i = dloss_i/dz_i * (1 - (z_i / c) ** 2)    (soft-capping's chain rule)

Ignored tokens contribute exact zeros to the sum and the gradient. The caller scales by ``1 / denominator`` once
(``scale``), so the sum over shards is the normalised loss. The logits buffer becomes the gradient in place.
The logits may be one rank's rows of the vocabulary (a ``VocabSlice``, ``LinearHeadKernel`` in ``lm_head.py``): every
whole-vocabulary quantity (row maximum, sum of exponentials, sum of logits, the target's logit) is then reduced
over the slice's group from the per-rank partials.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CrossEntropyOptions:
    ignore_index: int = -100
    label_smoothing: float = 0.0
    logit_softcap: Optional[float] = None
    z_loss: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if not self.z_loss >= 0:
            raise ValueError(f"z_loss must be >= 0, got {self.z_loss}")
        cap = self.logit_softcap
        if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0):
            raise ValueError(f"logit_softcap must be a number > 0 or None, got {cap!r}")


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Labels out of range would read a wrong logit (``gather``) where cross_entropy raises: refuse them."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        values = sorted(set(targets[bad].tolist()))[:5]
        raise ValueError(f"tiled loss: labels {values} are outside the vocabulary [0, {vocab}) and are not "
                         f"ignore_index ({ignore_index})")


def cross_entropy_shard(logits: torch.Tensor, targets: torch.Tensor, options: CrossEntropyOptions,
                        scale: torch.Tensor, with_grad: bool,
                        split: Optional[Tuple[int, int, Any]] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the shard's summed loss times ``scale``; its gradient with respect to ``logits`` when ``with_grad``).
    ``logits`` (``[tokens, columns]``, in the loss dtype) is overwritten: the gradient is written into it.
    ``split``: the logits are columns of a vocabulary split over a group, as (the vocabulary id of the first,
    the whole vocabulary's size, the group); None: they are all of it."""
    valid = targets != options.ignore_index
    start, vocab, group = split if split is not None else (0, logits.shape[-1], None)
    columns = targets - start
    # The target's column, where these logits hold it (every valid target, for a whole vocabulary).
    owned = valid & (columns >= 0) & (columns < logits.shape[-1])
    safe_targets = torch.where(owned, columns, 0).unsqueeze(1)
    cap = options.logit_softcap
    capped: Optional[torch.Tensor] = None
    if cap is not None:
        capped = logits.div_(cap).tanh_()  # t = tanh(l / c), kept for the chain rule
        z = capped.mul(cap) if with_grad else capped.mul_(cap)
    else:
        z = logits
    eps, lam = options.label_smoothing, options.z_loss
    target_z = torch.where(owned, z.gather(1, safe_targets).squeeze(1), 0)
    sum_z = z.sum(dim=1) if eps else None
    row_max = z.amax(dim=1, keepdim=True)
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    # exp(z - max) in place: z becomes the unnormalised softmax.
    exp = z.sub_(row_max).exp_()
    # The per-row partials reduced together (one collective per shard for a split vocabulary).
    partials = torch.stack([exp.sum(dim=1), target_z] + ([sum_z] if sum_z is not None else []))
    if group is not None:
        dist.all_reduce(partials, group=group)
    sum_exp, target_z = partials[0], partials[1]
    lse = sum_exp.log() + row_max.squeeze(1)
    token_loss = (1 - eps) * (lse - target_z)
    if eps:
        token_loss = token_loss + eps * (lse - partials[2] / vocab)
    if lam:
        token_loss = token_loss + lam * lse.square()
    weight = valid.to(z.dtype) * scale
    loss = (token_loss * weight).sum()
    if not with_grad:
        return loss, None
    # A call with no valid token has scale 1/0: its loss is NaN, as F.cross_entropy's mean, but an ignored
    # token's gradient is exactly 0 there too (0 * inf would make it NaN, and a caller that masks the NaN
    # loss away, as the Trainer's SP loss does for a rank without labels, would get NaN gradients).
    weight = torch.where(valid, weight, 0)
    # softmax * (1 + 2 lam lse) * weight, then the target and smoothing terms, all per row.
    row_factor = weight / sum_exp
    if lam:
        row_factor = row_factor * (1 + 2 * lam * lse)
    grad = exp.mul_(row_factor.unsqueeze(1))
    grad.scatter_add_(1, safe_targets, torch.where(owned, -(1 - eps) * weight, 0).unsqueeze(1))
    if eps:
        grad.sub_((eps / vocab) * weight.unsqueeze(1))
    if capped is not None:
        # dl = dz * (1 - t^2); ``grad`` lives in ``z``'s buffer, ``t`` in ``logits``' (``capped``).
        grad.mul_(capped.square_().neg_().add_(1))
    return loss, grad
