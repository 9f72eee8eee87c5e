"""Ulysses sequence parallelism on a Hugging Face model, beside the tiled MLP and the tiled loss (docs/long-context-stack.md,
"Sequence parallelism"). The engine is DeepSpeed's; this module adds the composition: the tiled loss divides once
over the group, masks DeepSpeed's wrapper drops are rebuilt or refused (``ulysses_masks``), a length-dependent RoPE
gets the whole sequence's frequencies (``ulysses_rope``), and the process-wide state SP writes is put back."""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .causal_lm_loss import check_tiled_loss, tiled_loss_forward
from .seams import deepspeed_internals, transformers_internals
from .seams.deepspeed_internals import DeepSpeedSlots
from .ulysses_masks import attention_kind, capture_padding, check_masks, whole_sequence_attention
from .ulysses_rope import length_dependent_rotaries, whole_sequence_rope

NO_TILED_LOSS_ERROR = (
    "sequence parallelism: {model} has no tiled loss. Under SP each rank holds a slice of the sequence, and the "
    "model's own loss would be a mean over that slice (wrong whenever the ranks' valid tokens differ). Put the "
    "tiled loss on first: apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model)."
)
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
HELD_ATTENTION_ERROR = (
    "sequence parallelism: transformers' attention under {name!r} is held, process-wide, by an earlier Ulysses SP "
    "stack (on {holder}), applied and not removed; its entry routes that stack's model through DeepSpeed's "
    "all-to-all. One SP stack per process at a time: call .remove() on the earlier handle (the LongContextStack "
    "apply_long_context returned, or the SequenceParallel of apply_sequence_parallel), also after a failed "
    "forward, then apply again."
)
TENSOR_PARALLEL_ERROR = (
    "sequence parallelism: {module}'s parameters {names} are DTensors (tensor parallelism: parallelize_module). "
    "DeepSpeed's Ulysses attention exchanges whole attention heads across the SP ranks and is built for the "
    "config's {heads} query heads; under tensor parallelism a rank holds only its slice of the heads, which the "
    "all-to-all would treat as whole. Ulysses SP and tensor parallelism on the attention do not compose here: "
    "leave q_proj/k_proj/v_proj/o_proj out of the tensor-parallel plan, or use "
    "tensor parallelism without sequence parallelism."
)
# The attribute marking the attention function an SP stack put in transformers' process-wide registry.
_HELD_BY = "_tiled_mlp_sequence_parallel_model"


@dataclass
class SequenceParallel:
    """Ulysses SP installed on a model: its group, how to feed it, and how to take it off."""

    model: nn.Module
    group: Any  # torch.distributed.ProcessGroup of the ranks that share each sequence
    mpu: Any  # DeepSpeed's SP state (``parallel_state_sp``): pass as ``deepspeed.initialize(mpu=...)``
    attention_implementation: str  # the model's attn_implementation, under which the Ulysses wrapper is registered
    # What puts the attention, the modules and the hooks back, run last first by remove()
    _undo: List[Callable[[], None]] = field(default_factory=list, repr=False)
    micro_batch_size: int = 1  # samples per batch, what DeepSpeed's Ulysses attention was built for
    # DeepSpeed's ``mpu`` slots before SP (later engines read their groups there): put back by remove()
    _deepspeed_slots: DeepSpeedSlots = field(default_factory=DeepSpeedSlots.remember, repr=False)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def shard(self, batch: Mapping[str, Any]) -> Dict[str, Any]:
        """This rank's slice of a batch every rank holds whole, cut as DeepSpeed's data-loader adapter cuts it:
        ``labels`` become ``shift_labels`` shifted over the whole sequence, ``position_ids`` default to ``arange``."""
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
        """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` around ``loader``: it needs ``position_ids`` in every batch
        and yields CPU tensors."""
        device = device if device is not None else next(self.model.parameters()).device
        return deepspeed_internals.data_loader(loader, self.rank, self.group, self.size, device)

    def remove(self) -> None:
        """Attention, loss, hooks and DeepSpeed's ``mpu`` slots as before SP; SP groups released. Call it once a
        DeepSpeed engine built with ``mpu=self.mpu`` is done with (it keeps asking for the groups)."""
        while self._undo:
            self._undo.pop()()
        installed = tiled_loss_forward(self.model)
        if installed is not None:
            installed.sequence_group = None
        deepspeed_internals.release_sp_groups()
        self._deepspeed_slots.restore()


def apply_sequence_parallel(model: nn.Module, size: int, *, micro_batch_size: int = 1) -> SequenceParallel:
    """Ulysses SP of ``size`` consecutive ranks on ``model`` (a causal LM with the tiled loss on it); every rank
    calls it. Every refusal comes before any change. ``.remove()`` on the handle undoes it."""
    held, rotaries = check_sequence_parallel(model, size)
    installed = tiled_loss_forward(model)
    if installed is None:
        raise ValueError(NO_TILED_LOSS_ERROR.format(model=type(model).__name__))
    attention = installed.model.config._attn_implementation

    ALL_ATTENTION_FUNCTIONS = transformers_internals.attention_functions()
    deepspeed_internals.init_distributed(dist.get_backend())
    decoder = installed.model.get_decoder()
    # What the name holds (``held``), a user's override included: this model's attention after the all-to-all,
    # and every other model's attention, are what they would be without SP.
    kind = attention_kind(held)
    undo = undo_attention(installed.model, attention, ALL_ATTENTION_FUNCTIONS)
    if held is not None:
        # DeepSpeed wraps what the name holds when it registers: it runs this after its all-to-all.
        ALL_ATTENTION_FUNCTIONS[attention] = whole_sequence_attention(held, kind, decoder.config)
    try:
        mpu = deepspeed_internals.register_ulysses(installed.model, attention, size, micro_batch_size)
    except BaseException:
        # DeepSpeed creates its SP groups before its own checks: a refused call must leave nothing behind.
        undo()
        deepspeed_internals.release_sp_groups()
        raise
    _scope_to(installed.model, attention, ALL_ATTENTION_FUNCTIONS, held)
    group = mpu.get_sequence_parallel_group()
    installed.sequence_group = group
    hooks = [*capture_padding(decoder, group, kind), *whole_sequence_rope(rotaries, group),
             guard_inputs(installed.model, micro_batch_size)]
    return SequenceParallel(model, group, mpu, attention, [undo, *(hook.remove for hook in hooks)], micro_batch_size)


def check_sequence_parallel(model: nn.Module, size: int) -> Tuple[Optional[Callable], List[nn.Module]]:
    """Every refusal that needs no change to make, before any (``apply_long_context`` asks first too). Returns
    what transformers' registry holds under the model's attention and its length-dependent rotary embeddings."""
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
        # The router's load-balancing loss is not a sum over tokens: a rank's slice gives another number.
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
    attention = config._attn_implementation
    held = transformers_internals.attention_functions().get(attention)
    holder = getattr(held, _HELD_BY, None)
    if holder is not None:
        owner = holder()
        described = f"{type(owner).__name__} at {id(owner):#x}" if owner is not None else "a model since deleted"
        raise RuntimeError(HELD_ATTENTION_ERROR.format(name=attention, holder=described))
    check_masks(text, attention, attention_kind(held))
    # Tensor parallelism on the attention; under FSDP2 its own sharded parameters are DTensors until its forward,
    # so there the attention call decides (``_scope_to``).
    from torch.distributed.fsdp import FSDPModule  # imported where used: it loads DTensor, seconds

    if not any(isinstance(m, FSDPModule) for m in causal_lm.modules()):
        for module in causal_lm.modules():  # every HF attention module has the num_key_value_groups DeepSpeed uses
            if isinstance(getattr(module, "num_key_value_groups", None), int):
                check_attention_not_tensor_parallel(module, heads)
    rotaries = length_dependent_rotaries(causal_lm)  # a length-dependent RoPE it cannot give the whole length: refused
    if deepspeed_internals.sp_groups_exist():
        raise RuntimeError("sequence parallelism: DeepSpeed's SP groups already exist in this process, process-wide: "
                           "an earlier apply_sequence_parallel or apply_long_context whose handle was not removed "
                           "(call its .remove()), or accelerate's ParallelismConfig(sp_backend='deepspeed')")
    return held, rotaries


def shares_heads(heads: int, kv_heads: int, size: int) -> Tuple[bool, bool]:
    """Whether ``size`` ranks divide the query heads, and divide or are a multiple of the key/value heads (DeepSpeed
    repeats each key/value head ``size / kv_heads`` times)."""
    return heads % size == 0, kv_heads % size == 0 or size % kv_heads == 0


def check_batch_size(batch: int, expected: int) -> None:
    if batch != expected:
        raise ValueError(BATCH_SIZE_ERROR.format(batch=batch, expected=expected))


def check_attention_not_tensor_parallel(attention: nn.Module, heads: object) -> None:
    from torch.distributed.tensor import DTensor

    names = [name for name, p in attention.named_parameters() if isinstance(p, DTensor)]
    if names:
        raise ValueError(TENSOR_PARALLEL_ERROR.format(module=type(attention).__name__, names=names, heads=heads))


def guard_inputs(model: nn.Module, micro_batch_size: int) -> Any:
    """A forward pre-hook refusing a batch of another size than DeepSpeed's attention was built for (its own assertion
    fires deep in the first attention call) and a call without ``position_ids``; returns its handle."""
    signature = inspect.signature(model.forward)

    def check(module: nn.Module, args: Tuple, kwargs: Dict) -> None:
        named: Dict[str, Any] = {**kwargs, **signature.bind_partial(*args).arguments}
        tokens = named.get("input_ids")
        tokens = tokens if tokens is not None else named.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor):
            return
        if tokens.dim() >= 2:
            check_batch_size(tokens.shape[0], micro_batch_size)
        if named.get("position_ids") is None:
            raise ValueError(NO_POSITIONS_ERROR.format(model=type(module).__name__))

    return model.register_forward_pre_hook(check, with_kwargs=True)


def _scope_to(model: nn.Module, attention: str, functions: Any, before: Optional[Callable]) -> None:
    """DeepSpeed writes its wrapper under ``attention`` for the whole process: every other model using that name (a
    reference or teacher model) would exchange heads too, silently wrong. Route only this model's modules to it."""
    ulysses = functions[attention]
    ours = weakref.WeakSet(model.modules())
    config: Any = model.config
    heads = config.get_text_config().num_attention_heads

    def scoped(module, *args, **kwargs):
        if module in ours:
            check_attention_not_tensor_parallel(module, heads)  # tensor parallelism applied after SP
            return ulysses(module, *args, **kwargs)
        if before is None:
            raise RuntimeError(f"sequence parallelism: no attention function was registered under {attention!r} before SP")
        return before(module, *args, **kwargs)

    setattr(scoped, _HELD_BY, weakref.ref(model))
    functions[attention] = scoped


def undo_attention(model: nn.Module, attention: str, functions: Any) -> Callable[[], None]:
    """What puts back the attention function under ``attention`` (an override absent before is deleted, not set, which
    would hide a later ``AttentionInterface.register``) and every module's ``num_key_value_groups`` (DeepSpeed sets it
    to 1 when SP replicates the key/value heads)."""
    local = functions._local_mapping  # an AttentionInterface's overrides of its defaults (transformers 5.6 to 5.25)
    before = local.get(attention)
    groups = {m: m.num_key_value_groups for m in model.modules() if isinstance(getattr(m, "num_key_value_groups", None), int)}

    def undo() -> None:
        if before is None:
            local.pop(attention, None)
        else:
            local[attention] = before
        for module, value in groups.items():
            module.num_key_value_groups = value

    return undo
