"""What makes a config unplannable, each said with what to do instead, before any step is modelled:
not a decoder-only language model, sizes no model can have, fused MoE experts in a dtype the meta
device cannot run, lengths past learned position embeddings, a tiled loss on a family whose loss path
the integration does not know. A last probe then runs one 16-token step at full depth, so that
whatever else breaks the model breaks there, in a clear error.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from .step import step_timeline

PROBE_TOKENS = 16
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok")


def check_config(config) -> None:
    """A ValueError naming the problem and the fix when ``config`` is not a decoder-only LM with
    possible sizes."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    # Encoders (bert, roberta) also have a causal-LM head class, and encoder-decoders (bart) their
    # decoder's: neither is the decoder-only model whose step the planner models.
    if (getattr(config, "is_encoder_decoder", False) or kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            or kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        raise ValueError(f"{kind} is not a decoder-only language model (encoder or encoder-decoder); the planner "
                         "models decoder-only models such as llama, qwen2, qwen3_moe, gemma2, mistral")
    text = config.get_text_config()
    for name in _SIZES:
        value = getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"{kind} config: {name} = {value}; every size must be 1 or more")
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ValueError(f"{kind} config: num_attention_heads = {heads} is not a multiple of num_key_value_heads = "
                         f"{kv_heads}; each group of query heads shares one key/value head")


def has_fused_experts(model: nn.Module) -> bool:
    """Experts stored as one 3-D parameter per projection ([experts, out, in]), which transformers runs
    through grouped_mm."""
    return any(isinstance(getattr(m, "num_experts", None), int) and any(p.dim() == 3 for p in m.parameters(recurse=False))
               for m in model.modules())


def check_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16 and has_fused_experts(model):
        raise ValueError(
            f"--dtype {str(dtype).replace('torch.', '')}: this MoE model runs its experts through grouped_mm, whose "
            "meta-device kernel takes bfloat16 only, so its step cannot be modelled in another dtype; use --dtype "
            "bfloat16 (what MoE models train in)")


def position_limit(model: Any, config) -> Optional[int]:
    """The longest sequence a model with learned position embeddings (GPT-2's ``wpe``) can run; None for
    rotary positions, which run past ``max_position_embeddings`` (``tiled-mlp plan`` warns there)."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    inputs = model.get_input_embeddings()
    learned = any(isinstance(m, nn.Embedding) and m is not inputs and m.num_embeddings == limit
                  for m in model.modules())
    return limit if learned else None


def build(config, dtype: torch.dtype, builder: Callable[[], nn.Module]) -> nn.Module:
    """``builder()``: a model of the config on the meta device; a ValueError naming what failed, or a
    dtype its experts cannot be modelled in."""
    try:
        model = builder()
    except Exception as error:  # whatever transformers raises for a config it cannot build, said once
        raise ValueError(f"{config.model_type}: transformers cannot build this model: {_reason(error)}") from error
    check_dtype(model, dtype)
    return model


def probe(model: nn.Module, config) -> None:
    """One short step of ``model`` (the full-depth model, or the shallow one a setting's steps run first),
    so that whatever else breaks the step breaks here, in a clear error, before the plan's steps."""
    try:
        step_timeline(model, PROBE_TOKENS, 1)
    except Exception as error:  # the same, for the step
        raise ValueError(f"{config.model_type}: a {PROBE_TOKENS}-token training step of this model fails on the "
                         f"meta device: {_reason(error)}") from error


def tiled_loss_refusal(model: nn.Module) -> str:
    """Why the tiled loss cannot be put on ``model`` ('' when it can): the integration knows the loss
    path of the families it names, and refuses the others rather than change their loss silently."""
    from ..integrations.causal_lm_loss import check_tiled_loss

    try:
        check_tiled_loss(model)
    except TypeError as error:
        return str(error)
    return ""


def _reason(error: BaseException) -> str:
    """The last line of what was raised (transformers' validation errors wrap the reason as the cause)."""
    cause = error.__cause__ or error
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(cause).__name__
