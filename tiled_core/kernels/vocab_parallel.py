"""The loss of an output head whose vocabulary is split over ranks (tensor parallelism: each rank holds
``[vocab / tp, hidden]`` rows of ``lm_head.weight`` and the whole hidden states): ``LinearHeadKernel`` on this
rank's rows, with the cross-entropy's whole-vocabulary quantities reduced over the group. Every rank gets the
same loss and its own rows' ``dW``; the input gradient is a partial sum the strategy reduces once per call
(``VocabSlice.hidden``). docs/backends.md, "The vocabulary-parallel tiled loss".
"""
from __future__ import annotations

from tiled_mlp.strategies.base import VocabSlice

from .cross_entropy import CrossEntropyOptions
from .lm_head import LinearHeadKernel


class VocabParallelHeadKernel(LinearHeadKernel):
    def __init__(self, vocab_slice: VocabSlice, module_name: str, options: CrossEntropyOptions):
        super().__init__(vocab_slice.weight, vocab_slice.bias, options, module_name, vocab_slice)
