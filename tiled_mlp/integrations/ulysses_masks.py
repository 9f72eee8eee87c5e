"""Causal order, sliding windows and padding for the attention under Ulysses SP. DeepSpeed's wrapper drops every
mask; after its all-to-all a rank holds the whole sequence for its heads, so under sdpa HF's own mask functions
build it there from the all-gathered padding (a decoder pre-hook passes it down as one more keyword argument) and
whether the decoder holds a cache (recorded by a layer pre-hook). Flash attention keeps the window but takes no
padding; any other attention gets DeepSpeed's causal call, so a window or padding under it is refused."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .seams import transformers_internals
from .seams.transformers_internals import MaskBuilder

WHOLE_SEQUENCE_KWARG = "ulysses_whole_sequence"
# The names HF decoders pass their cache to their layers under (``deprecate_kwarg`` renames the old ones).
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class WholeSequence:
    padding: Optional[torch.Tensor]  # [batch, all tokens] bool, as given to the model; None: no mask given
    masks: Dict[Optional[int], Optional[torch.Tensor]] = field(default_factory=dict)
    # Whether the decoder holds a cache in this call (HF then does not tell packed samples apart); None
    # until a decoder layer has reported what the decoder passed it.
    cached: Optional[bool] = None


# "sdpa" or "flash" for transformers' own functions (what the masks here are built for), "other" for any other.
attention_kind = transformers_internals.library_attention_kind


def is_windowed(config: Any) -> bool:
    # HF's rule: a window is set, and the layer types, where the config has them, name a sliding layer.
    layer_types = getattr(config, "layer_types", None)
    return getattr(config, "sliding_window", None) is not None and (
        layer_types is None or "sliding_attention" in layer_types)


def check_masks(config: Any, attention: str, kind: str) -> None:
    layer_types = set(getattr(config, "layer_types", None) or ())
    unknown = sorted(layer_types - set(KNOWN_LAYER_TYPES))
    if unknown:
        raise ValueError(f"sequence parallelism: layers of type {unknown} need their own attention masks, which "
                         f"Ulysses SP does not rebuild for the whole sequence (only {list(KNOWN_LAYER_TYPES)}); "
                         "this model is not supported under SP")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("sequence parallelism: chunked attention (config.attention_chunk_size) is not rebuilt for the "
                         "whole sequence under Ulysses SP; this model is not supported under SP")
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        raise ValueError("sequence parallelism: bidirectional attention is not rebuilt for the whole sequence under "
                         "Ulysses SP; use the model's causal attention (config.is_causal / use_bidirectional_attention)")
    if kind == "other" and is_windowed(config):
        raise ValueError(f"sequence parallelism: the attention function under {attention!r} (not transformers' own sdpa or "
                         "flash attention) gets DeepSpeed's causal mask after the all-to-all, "
                         f"without this model's sliding window ({config.sliding_window} tokens); use sdpa (exact: the "
                         "window is rebuilt for the whole sequence) or a flash-attention kernel (it takes the window)")


def capture_padding(decoder: nn.Module, group: Any, kind: str) -> List[Any]:
    """Hooks (returned) on ``decoder``, passing the attention the whole sequence's padding, and on its layers,
    recording whether the decoder gave them a cache."""
    checkpointing_layer = transformers_internals.checkpointing_layer_class()
    signature = inspect.signature(decoder.forward)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        arguments = signature.bind_partial(*args, **kwargs).arguments
        whole = WholeSequence(padding=whole_padding(arguments, group))
        if whole.padding is not None and kind != "sdpa" and not bool(whole.padding.all()):
            raise ValueError("sequence parallelism: a padding attention_mask cannot be applied under Ulysses SP with "
                             "this attention (DeepSpeed drops it after the all-to-all); use sdpa, where the padding is "
                             "applied to the whole sequence, or unpadded (packed) samples with position_ids")
        return args, {**kwargs, WHOLE_SEQUENCE_KWARG: whole}

    def layer_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        whole = kwargs.get(WHOLE_SEQUENCE_KWARG)
        given = [name for name in CACHE_KWARGS if name in kwargs]
        if isinstance(whole, WholeSequence) and given:
            whole.cached = kwargs[given[0]] is not None

    # Pre-hooks run in __call__, before GradientCheckpointingLayer's forward drops the cache for its
    # recompute: they see the cache the decoder built its masks with.
    return [decoder.register_forward_pre_hook(hook, with_kwargs=True)] + [
        m.register_forward_pre_hook(layer_hook, with_kwargs=True) for m in decoder.modules()
        if isinstance(m, checkpointing_layer)]


def whole_padding(arguments: Dict[str, Any], group: Any) -> Optional[torch.Tensor]:
    """The whole sequence's padding mask (None: no rank gave one). Every rank all-gathers, mask or not (a rank
    skipping the collective would hang the others), its slice with a leading column saying whether it gave one."""
    tokens = arguments.get("input_ids")
    tokens = tokens if tokens is not None else arguments.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        raise ValueError("sequence parallelism: the decoder was called without input_ids or inputs_embeds of shape "
                         "[batch, tokens, ...]")
    batch, local = tokens.shape[:2]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mask: Any = arguments.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch
                                 and mask.shape[1] in (local, local * size)):
        form = f"a {mask.dim()}-D tensor of shape {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"sequence parallelism: attention_mask must be the 2-D padding mask [batch, tokens] (this "
                         f"rank's {local} tokens, or all {local * size}); got {form}. Under Ulysses SP the attention "
                         "mask is rebuilt for the whole sequence from the padding, the window and position_ids")
    given = mask is not None
    part = torch.ones(batch, local, dtype=torch.long, device=tokens.device)
    if mask is not None:
        part = (mask[:, rank * local:(rank + 1) * local] if mask.shape[1] != local else mask).to(part.device, torch.long)
    flagged = torch.cat([torch.full((batch, 1), int(given), dtype=torch.long, device=tokens.device), (part != 0).long()], dim=1)
    parts = [torch.empty_like(flagged) for _ in range(size)]
    dist.all_gather(parts, flagged, group=group)
    flags = {int(p[0, 0]) for p in parts}
    if flags == {0}:
        return None
    if flags != {1}:
        raise ValueError("sequence parallelism: some ranks of the SP group passed an attention_mask and some did not; "
                         "pass each rank its slice of the same mask (or none on every rank)")
    padding = torch.cat([p[:, 1:] for p in parts], dim=1).bool()
    if mask is not None and mask.shape[1] != local and not torch.equal(padding, mask.to(padding.device) != 0):
        raise ValueError("sequence parallelism: the SP ranks passed different whole-sequence attention_masks")
    return padding


def whole_sequence_attention(library: Callable, kind: str, config: Any) -> Callable:
    """What DeepSpeed runs after its all-to-all: ``library`` with the whole sequence's mask under sdpa, else the call
    as it comes (a padding mask was refused in the decoder's hook, a window at apply)."""
    windowed = is_windowed(config)
    builders = transformers_internals.mask_builders()

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
             *args: Any, **kwargs: Any) -> Any:
        whole = kwargs.pop(WHOLE_SEQUENCE_KWARG, None)
        if not isinstance(whole, WholeSequence):
            raise RuntimeError("sequence parallelism: the attention ran without the whole sequence's padding; call the "
                               "model (or its decoder) that apply_sequence_parallel was given, not its layers alone")
        if windowed and "sliding_window" not in kwargs:
            raise RuntimeError(f"sequence parallelism: {type(module).__name__} does not pass its sliding_window to the "
                               "attention function, so its layer's window is unknown here; not supported under SP")
        if kind == "other" and whole.cached is not True and transformers_internals.packed_sequences(kwargs.get("position_ids")):
            # Without a cache HF hands the attention a mask that keeps packed samples apart; DeepSpeed hands this
            # attention none (flex: a causal BlockMask over the whole row), so the samples would attend across.
            raise RuntimeError(f"sequence parallelism: packed samples (position_ids restarting) without a cache, under "
                               f"the attention function {getattr(library, '__qualname__', library)!r}: it gets no "
                               "mask under SP and would attend across the samples. Use sdpa, or pad the samples "
                               "apart with an attention_mask under sdpa")
        if kind != "sdpa":
            return library(module, query, key, value, attention_mask, *args, **kwargs)
        if whole.cached is None:
            raise RuntimeError(f"sequence parallelism: no decoder layer of this model (HF's GradientCheckpointingLayer) "
                               f"reported whether the decoder holds a cache before {type(module).__name__} ran, so HF's "
                               "mask (packed samples told apart or not) is unknown here; not supported under SP")
        mask = whole.masks.get(kwargs.get("sliding_window"), ...)
        if mask is ...:
            mask = whole.masks[kwargs.get("sliding_window")] = hf_mask(config, query, whole, kwargs, builders)
        return library(module, query, key, value, mask, *args, **kwargs)

    return attention


def hf_mask(config: Any, query: torch.Tensor, whole: WholeSequence, kwargs: Dict[str, Any],
            builders: Tuple[MaskBuilder, MaskBuilder]) -> Any:
    """HF's sdpa mask for the whole sequence ``query`` covers, for the layer whose ``sliding_window`` is in ``kwargs``."""
    window = kwargs.get("sliding_window")
    if window is not None and window != getattr(config, "sliding_window", None):
        raise RuntimeError(f"sequence parallelism: a layer's sliding_window ({window}) is not the config's "
                           f"({getattr(config, 'sliding_window', None)}); HF's mask for it is unknown here")
    build = builders[0] if window is None else builders[1]
    # The mask functions read only the batch, the length, the dtype and the device of the embeddings.
    shape_only = query.new_empty((query.shape[0], query.shape[2], 0))
    # HF reads position_ids for packed samples only when its decoder holds no cache; with one, the mask is
    # causal over the row. A fresh cache sizes the mask as no cache does (no past tokens), so no cache.
    positions = None if whole.cached else kwargs.get("position_ids")
    if not whole.cached and positions is None:
        raise RuntimeError("sequence parallelism: the inner attention got no position_ids (DeepSpeed all-gathers them "
                           "before it); HF's mask for packed samples is unknown here")
    return build(config, shape_only, whole.padding, positions)
