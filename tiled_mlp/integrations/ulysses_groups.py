"""What Ulysses SP leaves in DeepSpeed's and transformers' process-wide state, and what it checks at each forward.

- DeepSpeed's ``mpu`` slots: ``deepspeed.initialize(mpu=sp.mpu)`` writes the SP state module into
  ``deepspeed.utils.groups.mpu`` (and ``deepspeed.checkpointing``'s), where every later engine reads its SP
  groups; once released, the next plain ``deepspeed.initialize`` stops on "sequence data parallel group is
  not initialized". ``DeepSpeedSlots`` puts back each slot that still holds the SP state.
- transformers' ``ALL_ATTENTION_FUNCTIONS`` is one per process: the entry SP writes is marked with its stack
  (``hold_attention``), so a second apply names the holder (``refuse_held_attention``).
- ``guard_inputs``: DeepSpeed's attention is built for a fixed micro batch (its assertion fires deep in the
  first attention call), and a slice's positions come only from ``position_ids``: both refused at the forward.
- DTensor tensor parallelism on the attention: ``UlyssesSPAttentionHF`` is built on the config's head counts
  and asserts whole heads, while a TP rank holds a slice (measured: SP=2 beside TP=2 on 4 gloo ranks stops at
  the first attention, naming neither problem nor fix). Refused at the attention call; at apply only on a
  model with no FSDP2 unit (whose sharded parameters are DTensors too until its forward).
"""
from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .seams.deepspeed_internals import MPU_SLOT_MODULES as _MPU_SLOTS
from .seams.deepspeed_internals import SP_STATE_MODULE as _SP_STATE_MODULE

BATCH_SIZE_ERROR = (
    "sequence parallelism: a batch of {batch} samples, but DeepSpeed's Ulysses attention was built for micro "
    "batches of {expected} (its shapes are fixed at apply time). Pass micro_batch_size={batch} to "
    "apply_sequence_parallel(model, size, micro_batch_size={batch}) (or apply_long_context(..., "
    "micro_batch_size={batch})), and feed every step that many samples. A short last batch of an epoch (HF "
    "Trainer's dataloader_drop_last=False, a DataLoader's drop_last=False) has fewer: drop it "
    "(dataloader_drop_last=True / drop_last=True)."
)
NO_POSITIONS_ERROR = (
    "sequence parallelism: {model} was called without position_ids. Under SP each rank holds a slice of the "
    "sequence, whose positions start where the slice starts; without them every rank counts from 0 (and a batch "
    "handed to every rank whole, not cut, goes unnoticed). Feed each rank sp.shard(batch) (it cuts the batch and "
    "adds position_ids) or batches from sp.data_loader(loader)."
)


def check_batch_size(batch: int, expected: int) -> None:
    if batch != expected:
        raise ValueError(BATCH_SIZE_ERROR.format(batch=batch, expected=expected))


@dataclass
class DeepSpeedSlots:
    """DeepSpeed's ``mpu`` slots as they were when SP was applied."""

    saved: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def remember(cls) -> DeepSpeedSlots:
        return cls({name: sys.modules[name].mpu for name in _MPU_SLOTS if name in sys.modules})

    def restore(self) -> None:
        """Each slot that holds DeepSpeed's SP state gets back what it held at apply time (None where the
        module was not loaded then); a slot someone set to anything else since is left alone."""
        state = sys.modules.get(_SP_STATE_MODULE)
        for name in _MPU_SLOTS:
            module = sys.modules.get(name)
            if module is not None and state is not None and getattr(module, "mpu", None) is state:
                setattr(module, "mpu", self.saved.get(name))  # noqa: B010 - a module's global, unknown to mypy


def _tokens_and_positions(model: nn.Module, args: Tuple, kwargs: Dict) -> Tuple[Optional[torch.Tensor], Any]:
    named: Dict[str, Any] = dict(kwargs)
    if args:
        try:
            named.update(inspect.signature(model.forward).bind_partial(*args).arguments)
        except TypeError:
            pass  # an unusual forward: judged by its keyword arguments
    tokens = named.get("input_ids")
    if tokens is None:
        tokens = named.get("inputs_embeds")
    return (tokens if isinstance(tokens, torch.Tensor) else None), named.get("position_ids")


def guard_inputs(model: nn.Module, micro_batch_size: int) -> Any:
    """A forward pre-hook on ``model`` (the causal LM under SP) refusing a batch of another size than
    ``micro_batch_size`` and a call without ``position_ids``; returns its handle."""

    def check(module: nn.Module, args: Tuple, kwargs: Dict) -> None:
        tokens, positions = _tokens_and_positions(module, args, kwargs)
        if tokens is None:
            return
        if tokens.dim() >= 2:
            check_batch_size(tokens.shape[0], micro_batch_size)
        if positions is None:
            raise ValueError(NO_POSITIONS_ERROR.format(model=type(module).__name__))

    return model.register_forward_pre_hook(check, with_kwargs=True)


# The attribute marking an attention function that an SP stack put in transformers' registry.
_HELD_BY = "_tiled_mlp_sequence_parallel_model"

HELD_ATTENTION_ERROR = (
    "sequence parallelism: transformers' attention under {name!r} is held, process-wide, by an earlier Ulysses SP "
    "stack (on {holder}), applied and not removed; its entry routes that stack's model through DeepSpeed's "
    "all-to-all. One SP stack per process at a time: call .remove() on the earlier handle (the LongContextStack "
    "apply_long_context returned, or the SequenceParallel of apply_sequence_parallel), also after a failed "
    "forward, then apply again."
)


def hold_attention(function: Callable, model: nn.Module) -> Callable:
    """``function`` (what SP writes under an attention name) marked as held by the stack on ``model``."""
    setattr(function, _HELD_BY, weakref.ref(model))
    return function


def refuse_held_attention(name: str, function: Any) -> None:
    """Refused when ``function`` (what transformers' registry holds under ``name``) was written by an SP
    stack not yet removed."""
    holder = getattr(function, _HELD_BY, None)
    if holder is None:
        return
    model = holder()
    described = f"{type(model).__name__} at {id(model):#x}" if model is not None else "a model since deleted"
    raise RuntimeError(HELD_ATTENTION_ERROR.format(name=name, holder=described))


TENSOR_PARALLEL_ERROR = (
    "sequence parallelism: {module}'s parameters {names} are DTensors (tensor parallelism: parallelize_module). "
    "DeepSpeed's Ulysses attention exchanges whole attention heads across the SP ranks and is built for the "
    "config's {heads} query heads; under tensor parallelism a rank holds only its slice of the heads, which the "
    "all-to-all would treat as whole. Ulysses SP and tensor parallelism on the attention do not compose here: "
    "leave q_proj/k_proj/v_proj/o_proj out of the tensor-parallel plan, or use "
    "tensor parallelism without sequence parallelism."
)


def check_attention_not_tensor_parallel(attention: nn.Module, heads: object) -> None:
    """Raise ``TENSOR_PARALLEL_ERROR`` where ``attention`` (a module Ulysses wraps) holds a DTensor parameter."""
    from torch.distributed.tensor import DTensor

    names = [name for name, p in attention.named_parameters() if isinstance(p, DTensor)]
    if names:
        raise ValueError(TENSOR_PARALLEL_ERROR.format(module=type(attention).__name__, names=names, heads=heads))


def check_no_tensor_parallel_attention(model: nn.Module, heads: object) -> None:
    """At apply time: refused where an attention module holds a DTensor parameter and no FSDP2 unit is on the
    model (whose own sharded parameters are DTensors until its forward; the attention call decides there)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return
    for module in model.modules():  # the attention modules: every HF one has the num_key_value_groups DeepSpeed uses
        if isinstance(getattr(module, "num_key_value_groups", None), int):
            check_attention_not_tensor_parallel(module, heads)
