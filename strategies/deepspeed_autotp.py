"""DeepSpeed AutoTP (training tensor parallelism, ``"tensor_parallel": {"autotp_size": N}``): a block holding its
layers is tiled as any other module; an AutoTP layer handed to the tiled call itself (the tiled loss's
``lm_head``) is claimed and refused before any work.

``deepspeed.initialize`` replaces a model's ``nn.Linear`` layers by its own classes
(``deepspeed.module_inject.layers``): ``LinearLayer`` (column-parallel: the weight's output rows split over
the TP ranks, the input gradient all-reduced in backward) and ``LinearAllreduce`` (row-parallel: the input
columns split, the output all-reduced in forward); ``lm_head`` becomes a ``LinearLayer`` that gathers the
vocabulary-sharded logits (or a ``VocabParallelLinear`` that keeps them sharded).

A block of them (an MLP): the fast kernel declines these layers by class (they are not ``nn.Linear``), and the
generic kernel runs the block's own forward once per shard, so ``LinearAllreduce`` all-reduces each shard's
partial sums, as one untiled call does all of them. Gloo holds the reduced tensor a moment after the
synchronous ``torch.distributed.all_reduce`` returns; the tiled call's check that no shard's tensor outlives
its shard waits for it, on every rank alike, because it sees the call: ``torch.distributed``'s collectives hand
themselves to torch function modes (``core/collectives.py``). The ranks run the same shard counts: they hold
the same tokens, and "auto" sizes shards for the largest share of an uneven split. No strategy of this file's
is needed there: the one that claims the engine's parameters (ZeRO's, or the single device's for stage 0)
delivers their gradients.

The loss's head: AutoTP's ``LinearLayer`` for ``lm_head`` holds this rank's rows of the vocabulary and gathers
the logits (``gather_output``), so its own forward, run once per shard by the tiled loss's module kernel, hands
every rank the whole vocabulary's logits, as untiled; the tiled loss reads the vocabulary from those logits,
not from the weight (``Strategy.head_weight_is_whole``). A row-parallel head (``LinearAllreduce``, as AutoTP
builds one from a row partition spec) holds every vocabulary row and all-reduces the logits: it needs nothing.
An AutoTP layer whose output stays split (a column-parallel one that does not gather), handed to the tiled call
itself, is claimed and refused.

Every rank holds the same layer classes, so every rank refuses at the same point: no collective is left
waiting. deepspeed is never imported here: the layers are recognised by their class's qualified name.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .base import Strategy, UnsupportedBackendError, claims_need_process_group
from .deepspeed_sp import is_instance_of

AUTOTP_LAYER_CLASS = ("deepspeed.module_inject.layers", "TensorParallel_Layer")

HEAD_ERROR = (
    "DeepSpeed AutoTP's {layer} was handed to the tiled call itself, and its output stays split over the ranks "
    "(weight {local} here): as the tiled loss's lm_head it would give each rank only its rows of the vocabulary's "
    "logits, and a tiled module would be one layer of a tensor-parallel pair. Compute the loss from the model's logits, "
    "keep AutoTP's gathering lm_head, or train with tensor_parallel.autotp_size 1 (a block holding AutoTP layers, "
    "an MLP, is tiled as usual: tile the block, not the layer)"
)
# The column-parallel layer whose ``gather_output`` hands every rank the whole output (AutoTP's lm_head).
AUTOTP_COLUMN_CLASS = ("deepspeed.module_inject.layers", "LinearLayer")
# The row-parallel layer (and its subclasses, the row-parallel training head among them): it all-reduces its
# output, whole on every rank, and its weight holds every output row (the input dimension is what is split).
AUTOTP_ROW_CLASS = ("deepspeed.module_inject.layers", "LinearAllreduce")


def gathers_logits(module: nn.Module) -> bool:
    """Whether ``module`` is AutoTP's column-parallel layer that gathers its output: its weight holds this rank's
    rows, its output every rank's."""
    return is_instance_of(module, AUTOTP_COLUMN_CLASS) and getattr(module, "gather_output", False) is True


def output_is_whole(module: nn.Module) -> bool:
    """Whether ``module``, an AutoTP layer, hands every rank its whole output: a gathering column-parallel layer,
    or a row-parallel one (its all-reduce)."""
    return gathers_logits(module) or is_instance_of(module, AUTOTP_ROW_CLASS)


class DeepSpeedAutoTPStrategy(Strategy):
    """Claims an AutoTP layer handed to the tiled call itself whose output is split over the ranks (ahead of the
    ZeRO strategy, which claims the same engine's modules) so that ``check_supported`` refuses it; a block
    holding such layers, AutoTP's gathering lm_head and a row-parallel layer are not its own."""

    name = "deepspeed_autotp"
    priority = 210
    claims_from_layout = True

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return is_instance_of(module, AUTOTP_LAYER_CLASS) and not output_is_whole(module)

    def check_supported(self, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        local = tuple(weight.shape) if weight is not None else "absent"
        raise UnsupportedBackendError(HEAD_ERROR.format(layer=type(module).__name__, local=local))
