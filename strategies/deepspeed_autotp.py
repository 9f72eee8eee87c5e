"""DeepSpeed AutoTP (training tensor parallelism, ``"tensor_parallel": {"autotp_size": N}``).

``deepspeed.initialize`` replaces ``nn.Linear`` layers by its own classes (``deepspeed.module_inject.layers``):
``LinearLayer`` (column-parallel, the input gradient all-reduced in backward) and ``LinearAllreduce``
(row-parallel, the output all-reduced in forward). A block of them (an MLP) is tiled as any other module: the fast
kernel declines them by class, the generic kernel runs the block's forward once per shard, and the strategy that
claims the engine's parameters delivers their gradients. The loss's head: AutoTP's ``lm_head`` is a ``LinearLayer``
that gathers the logits (``gather_output``), so the tiled loss reads the vocabulary from the logits, not from the
weight (``Strategy.head_weight_is_whole``); a row-parallel head needs nothing. An AutoTP layer whose output stays
split, handed to the tiled call itself, is claimed here and refused on every rank alike (docs/backends.md).
deepspeed is never imported: the layers are recognised by their class's qualified name.
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
