"""Every call the long-context stack makes into transformers' internals (``seams/__init__.py``)."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange, UncheckedVersionError

# 5.6.0: what LLaMA-Factory 0.9.5 pins (its newest allowed); 5.25.0: what TRL 1.16.0 installs. Every release
# between was checked for the names below; the suite runs on both ends (.ci/constraints-oldest.txt and
# .ci/constraints.txt).
CHECKED = CheckedRange("transformers", "5.6.0", "5.25.0")
# The cache argument of the mask builders, newest name first (5.24 renamed it).
_CACHE_KEYWORDS = ("cache", "past_key_values")
# What the stack passes every mask builder by name, besides the cache.
_MASK_ARGUMENTS = ("config", "inputs_embeds", "attention_mask", "position_ids")


def require(feature: str) -> str:
    return checked_versions.require(CHECKED, feature)


def attention_functions() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def library_attention_kind(function: Optional[Callable]) -> str:
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kinds: Dict[Any, str] = {sdpa_attention_forward: "sdpa", flash_attention_forward: "flash"}
    return kinds.get(function, "other")


def rope_update_wrapper_code() -> Any:
    """The code of ``dynamic_rope_update``'s wrapper (a constant of the decorator): a length-dependent rotary's forward
    when transformers' own rule picks its frequencies."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def checkpointing_layer_class() -> type:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def packed_sequences(positions: Optional[torch.Tensor]) -> bool:
    from transformers.masking_utils import find_packed_sequence_indices

    return positions is not None and find_packed_sequence_indices(positions) is not None


@dataclass(frozen=True)
class MaskBuilder:
    function: Callable
    cache_keyword: str

    def __call__(self, config: Any, inputs_embeds: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 position_ids: Optional[torch.Tensor]) -> Any:
        """The mask HF's decoder would build without a cache (``None`` where sdpa's causal flag is the mask)."""
        return self.function(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                             position_ids=position_ids, **{self.cache_keyword: None})


def mask_builders() -> Tuple[MaskBuilder, MaskBuilder]:
    """The full and sliding-window mask builders, adapted to the release's cache argument; refused where a builder
    takes other arguments than the checked releases' do."""
    from transformers import masking_utils

    return (_adapt(masking_utils.create_causal_mask), _adapt(masking_utils.create_sliding_window_causal_mask))


@functools.cache  # by the builder function's identity: its signature is read once
def _adapt(function: Callable) -> MaskBuilder:
    parameters = inspect.signature(function).parameters
    keyword = next((name for name in _CACHE_KEYWORDS if name in parameters), None)
    given = set(_MASK_ARGUMENTS) | set(_CACHE_KEYWORDS)
    missing = [name for name in _MASK_ARGUMENTS if name not in parameters]
    required = [name for name, p in parameters.items() if name not in given and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if keyword is None or missing or required:
        version = checked_versions.installed(CHECKED.package)
        raise UncheckedVersionError(
            f"transformers {version}: {function.__module__}.{function.__qualname__}{inspect.signature(function)} "
            f"does not take the arguments the stack passes ({', '.join(_MASK_ARGUMENTS)} and the cache as one "
            f"of {list(_CACHE_KEYWORDS)}), which {CHECKED.describe()} take; install a release in that range")
    return MaskBuilder(function, keyword)


def checkpoint_wraps_module_hooks() -> bool:
    """Whether HF's checkpointing layer runs its checkpoint in ``__call__``, around the module's hooks (up to at least
    5.6), rather than in ``forward`` (5.25); read from the class, not the version."""
    return "__call__" in vars(checkpointing_layer_class())
