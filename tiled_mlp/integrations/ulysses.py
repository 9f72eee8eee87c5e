"""Ulysses sequence parallelism on a Hugging Face model, beside the tiled MLP and the tiled loss.

The engine is DeepSpeed's (``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``); this module adds the
composition, described with what it refuses in docs/long-context-stack.md ("Sequence parallelism"): the
tiled loss divides once over the group (``tiled_core/sequence_group.py``; the backends' sum-or-average answer
is ``SequenceParallelAware``'s), the masks DeepSpeed's wrapper drops are rebuilt or refused
(``ulysses_masks.py``), a length-dependent RoPE gets the whole sequence's frequencies (``ulysses_rope.py``).
The model's own loss must not run under SP (a per-rank mean over a slice), so the tiled loss goes on first.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .seams import deepspeed_internals, transformers_internals
from .ulysses_groups import (
    DeepSpeedSlots,
    check_attention_not_tensor_parallel,
    check_batch_size,
    check_no_tensor_parallel_attention,
    guard_inputs,
    hold_attention,
    refuse_held_attention,
)
from .ulysses_masks import attention_kind, capture_padding, check_masks, whole_sequence_attention
from .ulysses_rope import length_dependent_rotaries, whole_sequence_rope

NO_TILED_LOSS_ERROR = (
    "sequence parallelism: {model} has no tiled loss. Under SP each rank holds a slice of the sequence, and the "
    "model's own loss would be a mean over that slice (wrong whenever the ranks' valid tokens differ). Put the "
    "tiled loss on first: apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model)."
)


@dataclass
class SequenceParallel:
    """Ulysses SP installed on a model: its group, how to feed it, and how to take it off."""

    model: nn.Module
    group: Any  # torch.distributed.ProcessGroup of the ranks that share each sequence
    mpu: Any  # DeepSpeed's SP state (``parallel_state_sp``): pass as ``deepspeed.initialize(mpu=...)``
    attention_implementation: str  # the model's attn_implementation, under which the Ulysses wrapper is registered
    _undo: Optional[Callable[[], None]] = field(default=None, repr=False)  # attention and modules as before
    micro_batch_size: int = 1  # samples per batch, what DeepSpeed's Ulysses attention was built for
    _input_guard: Any = field(default=None, repr=False)  # the forward pre-hook of ``ulysses_groups.guard_inputs``
    # DeepSpeed's ``mpu`` slots before SP (its groups are handed to engines through them): put back by remove()
    _deepspeed_slots: DeepSpeedSlots = field(default_factory=DeepSpeedSlots.remember, repr=False)

    @property
    def size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def shard(self, batch: Mapping[str, Any]) -> Dict[str, Any]:
        """This rank's slice of a batch every rank holds whole (``[batch, tokens]`` tensors), as DeepSpeed's
        data-loader adapter cuts a sample: ``labels`` become ``shift_labels`` shifted over the whole sequence
        before the split (a slice's last token predicts the next slice's first), ``position_ids`` default to
        ``arange``."""
        batch = dict(batch)
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("sequence parallelism: shard() needs input_ids of shape [batch, tokens]")
        check_batch_size(ids.shape[0], self.micro_batch_size)
        tokens = ids.shape[1]
        if tokens % self.size:
            raise ValueError(f"sequence parallelism: {tokens} tokens do not split across {self.size} ranks; pad the "
                             f"sequence to a multiple of {self.size} (labels -100 on the padding)")
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(tokens, device=ids.device).expand_as(ids)
        labels = batch.pop("labels", None)
        if labels is not None:
            batch["shift_labels"] = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        odd = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and (v.dim() < 2 or v.shape[1] != tokens)]
        if odd:  # a [b, 1, T, T] mask cut on its singleton dim, a scalar count: refused, as DeepSpeed's adapter does
            raise ValueError(f"sequence parallelism: shard() cuts every tensor along dim 1, the tokens; {odd} do not have "
                             f"{tokens} there. Leave them out (under SP attention takes no mask, position_ids order it)")
        chunk = tokens // self.size
        cut = slice(chunk * self.rank, chunk * (self.rank + 1))
        return {k: (v[:, cut] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def data_loader(self, loader: Iterable, device: Optional[torch.device] = None) -> Any:
        """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` around ``loader`` (each rank's loader yields its own
        samples; each sample is split across the group in turn). Unlike ``shard``, it requires
        ``position_ids`` in every batch and yields CPU tensors (DeepSpeed keeps the prefill on the host)."""
        device = device if device is not None else next(self.model.parameters()).device
        return deepspeed_internals.data_loader(loader, self.rank, self.group, self.size, device)

    def remove(self) -> None:
        """The model's attention and loss as before; DeepSpeed's SP groups released, and the slots DeepSpeed
        reads its groups from (``deepspeed.utils.groups.mpu``) as they were before SP, so that a later plain
        ``deepspeed.initialize`` builds an engine without SP. Call it once a DeepSpeed engine built with
        ``mpu=self.mpu`` is done with: the engine keeps asking for the released groups."""
        from .causal_lm_loss import tiled_loss_forward

        if self._undo is not None:
            self._undo()
            self._undo = None
        installed = tiled_loss_forward(self.model)
        if installed is not None:
            installed.sequence_group = None
        if self._input_guard is not None:
            self._input_guard.remove()
            self._input_guard = None
        deepspeed_internals.release_sp_groups()
        self._deepspeed_slots.restore()


def apply_sequence_parallel(model: nn.Module, size: int, *, micro_batch_size: int = 1) -> SequenceParallel:
    """Ulysses SP of ``size`` ranks on ``model`` (a causal LM with the tiled loss on it); every rank calls it,
    consecutive ranks share a sequence (DeepSpeed's layout). The model's attention implementation is wrapped
    for its own attention modules only. Every refusal (``check_sequence_parallel``) comes before any change.
    Returns the handle; ``.remove()`` undoes it."""
    import torch.distributed as dist

    from .causal_lm_loss import tiled_loss_forward

    check_sequence_parallel(model, size)
    installed = tiled_loss_forward(model)
    if installed is None:
        raise ValueError(NO_TILED_LOSS_ERROR.format(model=type(model).__name__))
    attention = installed.model.config._attn_implementation

    ALL_ATTENTION_FUNCTIONS = transformers_internals.attention_functions()
    deepspeed_internals.init_distributed(dist.get_backend())
    decoder = installed.model.get_decoder()
    # What the name holds, a user's override included: this model's attention after the all-to-all, and
    # every other model's attention, are what they would be without SP.
    held = ALL_ATTENTION_FUNCTIONS.get(attention)
    kind = attention_kind(held)
    undo = undo_attention(installed.model, attention, ALL_ATTENTION_FUNCTIONS)
    if held is not None:
        # DeepSpeed wraps what the name holds when it registers: it runs this after its all-to-all.
        ALL_ATTENTION_FUNCTIONS[attention] = whole_sequence_attention(held, kind, decoder.config)
    try:
        mpu = deepspeed_internals.register_ulysses(installed.model, attention, size, micro_batch_size)
    except BaseException:
        # DeepSpeed creates its SP groups before its own checks (eager refused, a config mismatch): a
        # refused call must leave nothing behind, or the next apply finds the groups "already exist".
        undo()
        deepspeed_internals.release_sp_groups()
        raise
    _scope_to(installed.model, attention, ALL_ATTENTION_FUNCTIONS, held)
    group = mpu.get_sequence_parallel_group()
    installed.sequence_group = group
    unhook = capture_padding(decoder, group, kind)
    unrope = whole_sequence_rope(length_dependent_rotaries(installed.model), group)

    def undo_all() -> None:
        unrope()
        unhook()
        undo()

    return SequenceParallel(model, group, mpu, attention, undo_all, micro_batch_size,
                            guard_inputs(installed.model, micro_batch_size))


def check_sequence_parallel(model: nn.Module, size: int) -> None:
    """Every refusal that needs no change to make, before any (``apply_long_context`` asks first too)."""
    import torch.distributed as dist

    from .causal_lm_loss import check_tiled_loss

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sequence parallelism: initialize torch.distributed first (every rank calls this)")
    transformers_internals.require("Ulysses sequence parallelism")
    deepspeed_internals.require("Ulysses sequence parallelism")
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise ValueError(f"sequence parallelism: size must be an int >= 2, got {size!r}")
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"sequence parallelism: the world of {world} ranks does not divide into groups of {size}")
    causal_lm, form = check_tiled_loss(model)
    if form.router_aux_loss:
        # The router's load-balancing loss is a function of every token's routing, not a sum over tokens: a
        # rank's slice gives another number, which this module does not reduce over the group.
        raise ValueError(f"sequence parallelism: {type(causal_lm).__name__} adds a router auxiliary loss, which is not "
                         "a sum over tokens and is not reduced across the SP ranks here; MoE models are not supported")
    config: Any = causal_lm.config  # a transformers PretrainedConfig
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if not all(shares_heads(heads, kv_heads, size)):
        raise ValueError(f"sequence parallelism: {size} ranks must divide the {heads} query heads, and divide or be a "
                         f"multiple of the {kv_heads} key/value heads (each rank attends over whole heads)")
    if config._attn_implementation in ("eager", "paged|eager"):
        raise ValueError("sequence parallelism: eager attention needs a [tokens, tokens] mask, which Ulysses drops; "
                         "use sdpa, flash_attention_2 or flex_attention (DeepSpeed's rule)")
    ALL_ATTENTION_FUNCTIONS = transformers_internals.attention_functions()
    attention = config._attn_implementation
    held = ALL_ATTENTION_FUNCTIONS.get(attention)
    refuse_held_attention(attention, held)
    check_masks(text, attention, attention_kind(held))
    check_no_tensor_parallel_attention(causal_lm, heads)
    length_dependent_rotaries(causal_lm)  # a length-dependent RoPE it cannot give the whole length: refused
    if deepspeed_internals.sp_groups_exist():
        raise RuntimeError("sequence parallelism: DeepSpeed's SP groups already exist in this process, process-wide: "
                           "an earlier apply_sequence_parallel or apply_long_context whose handle was not removed "
                           "(call its .remove()), or accelerate's ParallelismConfig(sp_backend='deepspeed')")


def shares_heads(heads: int, kv_heads: int, size: int) -> Tuple[bool, bool]:
    """Whether ``size`` ranks can share the query heads (it divides them: whole heads a rank) and the key/value
    heads (it divides them, or is a multiple: DeepSpeed repeats each key/value head ``size / kv_heads`` times)."""
    return heads % size == 0, kv_heads % size == 0 or size % kv_heads == 0


def _scope_to(model: nn.Module, attention: str, functions: Any, before: Optional[Callable]) -> None:
    """DeepSpeed writes its Ulysses wrapper under ``attention`` for the whole process: every model using that
    attention (a reference, teacher or evaluation model beside this one) would exchange heads across
    ranks too, and be silently wrong. Route only this model's attention modules to it, every other one
    to ``before`` (what the name held before SP, a user's override included)."""
    ulysses = functions[attention]
    ours = weakref.WeakSet(m for m in model.modules())
    config: Any = model.config
    heads = config.get_text_config().num_attention_heads

    def scoped(module, *args, **kwargs):
        if module in ours:
            # Tensor parallelism applied after SP: refused before DeepSpeed's all-to-all (``ulysses_groups.py``).
            check_attention_not_tensor_parallel(module, heads)
            return ulysses(module, *args, **kwargs)
        if before is None:
            raise RuntimeError(f"sequence parallelism: no attention function was registered under {attention!r} before SP")
        return before(module, *args, **kwargs)

    functions[attention] = hold_attention(scoped, model)


def undo_attention(model: nn.Module, attention: str, functions: Any) -> Callable[[], None]:
    """What puts back what DeepSpeed's SP changes outside its groups: the attention function under
    ``attention`` (DeepSpeed writes ``ALL_ATTENTION_FUNCTIONS``' per-instance override: one absent before is
    deleted, not set, which would hide a later ``AttentionInterface.register``), and every attention module's
    ``num_key_value_groups`` (DeepSpeed sets it to 1 when SP replicates the key/value heads)."""
    local = getattr(functions, "_local_mapping", None)
    had_override = local is not None and attention in local
    before = functions.get(attention)
    groups = {m: m.num_key_value_groups for m in model.modules() if isinstance(getattr(m, "num_key_value_groups", None), int)}

    def undo() -> None:
        if local is not None and not had_override:
            local.pop(attention, None)
        elif before is not None:
            functions[attention] = before
        for module, value in groups.items():
            module.num_key_value_groups = value

    return undo
