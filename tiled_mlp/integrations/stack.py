"""The long-sequence stack in one call, and off again in one: tiled MLP, RMSNorms and loss, checkpoint offload and
Ulysses SP. The loss goes first (SP divides its per-rank sums over the group); SP's refusals come before any
change, and an error at a later step undoes the steps before it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from tiled_mlp.core.checkpoint_offload import CheckpointOffload
from tiled_mlp.core.shard_plan import NumShards

from .args import TiledMLPFlags, check_switches, read_tiled_mlp_flags
from .causal_lm_loss import is_tiled_loss
from .hf import apply_tiled_mlp, is_tiled, remove_tiled_mlp
from .offload import apply_checkpoint_offload, checkpointed_layers, checkpointing_on
from .report import TilingReport
from .ulysses import SequenceParallel, apply_sequence_parallel, check_sequence_parallel


@dataclass
class LongContextStack:
    model: nn.Module
    report: Optional[TilingReport] = None
    offload: Optional[CheckpointOffload] = None
    sequence_parallel: Optional[SequenceParallel] = None
    checkpointing_turned_on: Optional[Callable[[], None]] = None  # turns off what this stack turned on

    def remove(self) -> None:
        if self.sequence_parallel is not None:
            self.sequence_parallel.remove()
            self.sequence_parallel = None
        if self.offload is not None:
            self.offload.remove()
            self.offload = None
        if self.checkpointing_turned_on is not None:
            self.checkpointing_turned_on()
            self.checkpointing_turned_on = None
        if self.report is not None:
            remove_tiled_mlp(self.model)  # the tiled loss too
            self.report = None


def apply_long_context(
    model: nn.Module,
    *,
    tiled_mlp: bool = True,
    tiled_loss: bool = True,
    tiled_norms: bool = True,
    checkpoint_offload: bool = True,
    sequence_parallel: int = 1,
    num_shards: NumShards = "auto",
    loss_num_shards: NumShards = "auto",
    micro_batch_size: int = 1,
    grad_accum_dtype: Optional[torch.dtype] = None,
    **tiling: Any,
) -> LongContextStack:
    """The stack on ``model``; ``tiling``: more options of ``apply_tiled_mlp``. Under SP every rank calls it and feeds
    ``handle.sequence_parallel.shard(batch)``."""
    check_switches("apply_long_context", tiled_mlp=tiled_mlp, tiled_loss=tiled_loss, tiled_norms=tiled_norms,
                   checkpoint_offload=checkpoint_offload)
    if sequence_parallel != 1 and not tiled_loss:
        raise ValueError("apply_long_context: sequence_parallel > 1 needs tiled_loss=True (the loss of a sequence "
                         "split across ranks is summed per rank and divided once by the group's valid tokens)")
    if tiling and not (tiled_mlp or tiled_norms):
        raise ValueError(f"apply_long_context: {sorted(tiling)} are apply_tiled_mlp's options, and with tiled_mlp=False "
                         "and tiled_norms=False nothing is tiled to take them")
    if "include" in tiling and not tiled_mlp:
        raise ValueError("apply_long_context: include selects MLP blocks to tile, and tiled_mlp=False tiles none")
    if is_tiled(model) or is_tiled_loss(model):
        raise ValueError("apply_long_context: the model already has tiled MLPs or the tiled loss on it; take them off "
                         "first (remove_tiled_mlp), or compose the pieces one by one (apply_tiled_mlp, "
                         "apply_checkpoint_offload, apply_sequence_parallel)")
    if checkpoint_offload and any(layer._forward_pre_hooks for layer in checkpointed_layers(model)):
        raise ValueError("apply_long_context: the model's checkpointed layers already carry forward pre-hooks (an "
                         "offload applied before?); remove it first, or compose the pieces one by one")
    if sequence_parallel != 1:
        check_sequence_parallel(model, sequence_parallel)
    stack = LongContextStack(model)
    try:  # each piece is recorded on the handle as soon as it is on, so remove() undoes exactly those
        if tiled_mlp or tiled_norms or tiled_loss:
            if not tiled_mlp:
                tiling["include"] = []  # the norms or the loss alone: an empty include selects no MLP block
            stack.report = apply_tiled_mlp(model, num_shards=num_shards, loss=tiled_loss, norms=tiled_norms,
                                           loss_num_shards=loss_num_shards, grad_accum_dtype=grad_accum_dtype, **tiling)
        if checkpoint_offload:
            if not checkpointed_layers(model):
                stack.checkpointing_turned_on = checkpointing_on(model)
            stack.offload = apply_checkpoint_offload(model)
        if sequence_parallel != 1:
            stack.sequence_parallel = apply_sequence_parallel(model, sequence_parallel,
                                                              micro_batch_size=micro_batch_size)
    except BaseException:
        stack.remove()
        raise
    return stack


def apply_from_flags(model: nn.Module, source, **kwargs) -> Optional[LongContextStack]:
    """``apply_long_context`` as the flags (read already, or parsed arguments or a training config's dict) ask; None
    when they ask for nothing."""
    flags = source if isinstance(source, TiledMLPFlags) else read_tiled_mlp_flags(source)
    if not flags.asks_for_anything:
        return None
    return apply_long_context(model, tiled_mlp=flags.use_tiled_mlp, tiled_loss=flags.use_tiled_loss,
                              tiled_norms=flags.use_tiled_norms,
                              checkpoint_offload=flags.use_checkpoint_offload,
                              sequence_parallel=flags.ulysses_sp_size, num_shards=flags.num_shards, **kwargs)
