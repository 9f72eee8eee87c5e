"""DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``) replaces ``nn.Linear`` layers by its own classes.
A block of them (an MLP) is tiled as any other module: the fast kernel declines them by class and the strategy
that claims the engine's parameters delivers their gradients. AutoTP's ``lm_head`` gathers the logits, so the
tiled loss reads the vocabulary from them (``HeadCall.weight_is_whole``). An AutoTP layer whose output stays
split, handed to the tiled call itself, is refused. Recognised by qualified class name: deepspeed is not imported.
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
# The row-parallel layer (and its subclasses): it all-reduces its output, whole on every rank.
AUTOTP_ROW_CLASS = ("deepspeed.module_inject.layers", "LinearAllreduce")


def gathers_logits(module: nn.Module) -> bool:
    return is_instance_of(module, AUTOTP_COLUMN_CLASS) and getattr(module, "gather_output", False) is True


class DeepSpeedAutoTPStrategy(Strategy):
    name = "deepspeed_autotp"
    priority = 210  # ahead of the ZeRO strategy, which claims the same engine's modules
    claims_from_layout = True

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        whole = gathers_logits(module) or is_instance_of(module, AUTOTP_ROW_CLASS)
        return is_instance_of(module, AUTOTP_LAYER_CLASS) and not whole

    def check_supported(self, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        local = tuple(weight.shape) if weight is not None else "absent"
        raise UnsupportedBackendError(HEAD_ERROR.format(layer=type(module).__name__, local=local))
