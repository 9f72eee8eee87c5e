"""The loss of an output head whose vocabulary is split over ranks (tensor parallelism: each rank holds
``[vocab / tp, hidden]`` rows of ``lm_head.weight`` and the whole hidden states).

``LinearHeadKernel`` on this rank's rows, with the cross-entropy's whole-vocabulary quantities (the row
maximum, the sum of exponentials, the target's logit, the sum of logits) reduced over the group
(``cross_entropy.VocabSpan``): every rank gets the same loss and its own rows' ``dW``, with no collective; the
input gradient is a partial sum the caller reduces once per call (``VocabSlice.hidden``). Every rank runs the
same shards, so the ranks issue the same collectives in the same order. docs/backends.md, "The
vocabulary-parallel tiled loss".
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
