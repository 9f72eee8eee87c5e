"""The loss of an output head whose vocabulary is split over ranks (tensor parallelism: each rank of
a group holds some rows of ``lm_head.weight``, ``[vocab / tp, hidden]``, and the whole hidden states).

Per token shard each rank computes its own columns of the logits, ``x_s @ W_local.T`` (``[s, vocab / tp]``,
never the whole vocabulary, never the whole sequence), and the cross-entropy of ``cross_entropy.py``
over the whole vocabulary: the row maximum is all-reduced (max), then the sum of exponentials, the
target's logit (picked by the one rank whose rows hold it, zero elsewhere) and, under label smoothing,
the sum of the logits, in one all-reduce (sum). Every rank gets the same loss, and the gradient of its
own columns, from which ``LinearHeadKernel``'s matmuls (the same code) form:

- ``dW_local`` (and ``db_local``): this rank's rows, complete: no collective;
- ``dx_s = dlogits_local @ W_local``: this rank's part of a sum over the group. It is written into the
  call's one ``dx`` buffer and reduced once per call, not per shard: the sum over ranks is linear, so
  reducing the summed buffer is the same sum, with one collective instead of one per shard. The caller
  makes the hidden states a local view whose gradient autograd all-reduces over the group on the way
  back (``VocabSlice.hidden``), so the kernel itself issues no collective in backward.

Every rank runs the same shards (the same tokens, and a shard count sized on the most rows any rank
holds), so the ranks issue the same collectives in the same order.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from tiled_mlp.strategies.base import VocabSlice

from .cross_entropy import CrossEntropyOptions, VocabSpan
from .lm_head import LinearHeadKernel


def group_span(vocab_slice: VocabSlice) -> VocabSpan:
    """The span of ``vocab_slice``'s rows, reduced over its group."""
    group = vocab_slice.group

    def all_max(rows: torch.Tensor) -> None:
        dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)

    def all_sum(rows: torch.Tensor) -> None:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)

    return VocabSpan(vocab_slice.start, vocab_slice.vocab_size, all_max, all_sum)


class VocabParallelHeadKernel(LinearHeadKernel):
    """``LinearHeadKernel`` on this rank's rows, its cross-entropy reduced over the group."""

    def __init__(self, vocab_slice: VocabSlice, module_name: str, options: CrossEntropyOptions):
        super().__init__(vocab_slice.weight, vocab_slice.bias, options, module_name, group_span(vocab_slice))


@runtime_checkable
class SplitsHeadVocabulary(Protocol):
    """A strategy whose heads may hold a slice of the vocabulary per rank (tensor parallelism): the
    tiled loss asks it for this rank's view of the head, and computes with that alone."""

    def vocab_slice(self, head: Any, hidden: torch.Tensor) -> VocabSlice:
        """This rank's view of ``head`` for the loss of ``hidden`` (the head was checked by the strategy's
        ``check_supported``)."""
