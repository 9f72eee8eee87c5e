"""Autograd's saved-tensor version check, for the tensors a tiled call keeps by reference (backends swap
parameter storage between forward and backward, which a saved tensor would refuse), and the sharded Function's
other refusals. The plain values its recompute reads are compared in ``plain_values``.
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch

from .tensor_reads import describe

MODIFIED_ERROR = (
    "one of the variables needed for gradient computation has been modified by an inplace operation: "
    "{tensor} is at version {now}; expected version {then} instead. It was read by {where} in its forward, "
    "and the backward recomputes from it (TiledMLP). Make the in-place change after the backward, or on a copy."
)
INPUT_EDITED_ERROR = (
    "TiledMLP: the forward of {module} modified its input in place. The tiled backward recomputes each shard "
    "from the input, which no longer holds what the forward saw, so its gradients would be wrong. Compute on "
    "a copy (x = x * 2 instead of x.mul_(2)), or run the module untiled (untile(module))."
)
DOUBLE_BACKWARD_ERROR = (
    "TiledMLP does not support double backward: a backward with create_graph=True reached it "
    "(torch.autograd.functional.hessian or hvp, a gradient penalty). Its backward recomputes shard by shard "
    "without building a graph, so every second-order term through it would be zero. Run this module untiled "
    "for second-order gradients (untile(module))."
)

version_of = operator.attrgetter("_version")


def raise_modified(tensors: Sequence[torch.Tensor], versions: Sequence[int], where: str) -> None:
    """Autograd's error for the first of ``tensors`` no longer at its version (the caller compared them)."""
    i = next(i for i, (t, v) in enumerate(zip(tensors, versions, strict=True)) if t._version != v)
    raise RuntimeError(MODIFIED_ERROR.format(tensor=describe([tensors[i]]), now=tensors[i]._version,
                                             then=versions[i], where=where))
