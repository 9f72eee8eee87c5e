from __future__ import annotations

import contextlib
from typing import ContextManager, List, Optional, Protocol, Sequence

import torch

from ..grad_accum import GradAccumulator


class ShardKernel(Protocol):
    """The per-shard computation. Shards are 2-D ``[shard_tokens, features]`` slices.

    ``tensors`` are the tensors the sharded Function was given (the parameters it returns gradients
    for, then any other tensor the forward was found to read): forward and backward compute with
    exactly these, never with what the module holds at backward time (``torch.func.functional_call``
    swaps the module's parameters only for the duration of its call).

    Not part of this contract: the built-in gated kernel's ``_output_width(tensors)``, with which the
    sharded Function allocates the whole output before the first shard. A declared width and dtype are
    trusted, not checked (a wrong one would be broadcast into the output in silence), so only a kernel
    whose output provably has them declares it: the gated kernel writes the down projection's rows
    with ``out=``, in the input's dtype.
    """

    #: The parameters the autograd Function takes as inputs and returns gradients for, in order.
    params: List[torch.Tensor]
    #: Every parameter the module owns, trained or not: never mistaken for another tensor the forward
    #: reads (a parameter the strategy leaves out of ``params`` gets no gradient from the tiled call).
    owned_params: List[torch.Tensor]
    #: Whether the forward may read tensors besides the input and ``params`` (then they are found and
    #: made inputs of the Function too, so that their gradients are not lost).
    may_read_other_tensors: bool
    #: The module's class name, for error messages.
    module_name: str
    #: Whether a shard's forward may draw random numbers, whose RNG state the backward recompute
    #: replays (a kernel without the attribute is taken to draw them).
    replays_rng: bool

    def forward_shard(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor],
                      tensors: Sequence[torch.Tensor], shard: Optional[slice] = None) -> torch.Tensor:
        """Compute the shard's output, with no graph kept, into ``out_shard`` when one is given.
        ``shard``: which tokens of the call ``x_shard`` holds (a kernel with other sharded inputs, the
        generic kernel's ``token_inputs``, slices them the same way)."""

    def remember_reads(self, tensors: Sequence[torch.Tensor]) -> None:
        """The tensors without a gradient that the forward read (called only where
        ``may_read_other_tensors``): the backward recompute must read these same ones, unchanged."""

    def using(self, tensors: Sequence[torch.Tensor]) -> ContextManager:
        """Inside: the module computes with ``tensors`` (around the backward recompute)."""

    def backward_shard(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, grad_in_shard: Optional[torch.Tensor],
                       grads: GradAccumulator, tensors: Sequence[torch.Tensor], shard: Optional[slice] = None) -> None:
        """Recompute what the shard needs, write its input gradient into ``grad_in_shard`` (when
        given) and add the gradients of ``tensors`` to ``grads``."""


def no_substitution(tensors: Sequence[torch.Tensor]) -> ContextManager:
    return contextlib.nullcontext()


class ReduceKernel(Protocol):
    """The per-shard computation of the reduction shape (a loss): one shard's contribution to a sum,
    with its gradients formed at once (``sharded_reduce``)."""

    #: The parameters the autograd Function takes as inputs and returns gradients for, in order.
    params: List[torch.Tensor]
    module_name: str

    def compute_tensors(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """What every shard of the call on ``x`` computes with, made once per call from the Function's
        ``tensors`` (a cast to the compute dtype). Returned, not kept on the kernel: a kernel holds no
        tensor of a call, so nothing of the call outlives it (nor escapes a traced forward as a side effect)."""

    def shard(self, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, dx: Optional[torch.Tensor],
              grads: Optional[GradAccumulator], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shard's loss times ``scale`` (0-dim); its input gradient into ``dx`` and its parameters'
        into ``grads`` where given (each for the scaled loss). ``tensors``: ``compute_tensors``' answer."""
