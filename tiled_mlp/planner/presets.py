"""Built-in model sizes (numbers from the models' published ``config.json``), and loading a config.

Nothing is downloaded: a CONFIG is a preset name or a local ``config.json`` (or a directory holding
one), read by transformers' ``AutoConfig``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple, Type

PRESETS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=131072, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                                        max_position_embeddings=40960, tie_word_embeddings=False)),
    "gemma-2-9b": ("gemma2", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                                  max_position_embeddings=8192)),
}


def _validation_errors() -> Tuple[Type[BaseException], ...]:
    """What transformers >= 5 raises for a config whose sizes no model can have (hidden size not a
    multiple of the heads): huggingface_hub's strict-dataclass error, no ValueError."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def load_config(spec: str):
    """A transformers config from a preset name or a local path; a clear error for anything else."""
    from transformers import AutoConfig

    key = spec.lower()
    if key in PRESETS:
        model_type, sizes = PRESETS[key]
        return AutoConfig.for_model(model_type, **sizes)
    path = spec
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"--model {spec}: cannot read a transformers config from {path}: {error}") from error
        except _validation_errors() as error:
            reason = str(error.__cause__ or error).strip().splitlines()[-1].strip()
            raise ValueError(f"--model {spec}: {path} describes a model that cannot exist: {reason}") from error
    looks_like_path = os.sep in spec or spec.endswith(".json")
    if looks_like_path:
        raise ValueError(f"--model {spec}: no such file or directory (a config.json, or a directory holding one)")
    raise ValueError(f"--model {spec}: not a known preset and not a local path; presets: {', '.join(sorted(PRESETS))}")
