"""A tiny model saved as a local checkpoint folder with a tokenizer built here: what a framework that
loads by path (LLaMA-Factory's ``model_name_or_path``, Axolotl's ``base_model``) trains, with no download.

The model is ``tiny_models.tiny_model`` (random weights); the tokenizer is a word-level one over
``WORDS`` plus the special tokens, exactly ``tiny_models.VOCAB`` entries, so no framework resizes the
embeddings. ``sentences`` makes training text from those words only (no unknown token).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import List

import torch

from .tiny_models import VOCAB, tiny_model

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def save_tiny_checkpoint(folder: Path, family: str = "llama", seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> Path:
    """The model and tokenizer saved under ``folder``; returns it."""
    model = tiny_model(family, seed=seed, dtype=dtype)
    ids = tokenizer()
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = (
        ids.bos_token_id, ids.eos_token_id, ids.pad_token_id)
    model.generation_config.bos_token_id = ids.bos_token_id
    model.generation_config.eos_token_id = ids.eos_token_id
    model.generation_config.pad_token_id = ids.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    ids.save_pretrained(folder)
    return folder


def sentences(count: int, words: int, seed: int = 0) -> List[str]:
    """``count`` texts of ``words`` words from the tokenizer's vocabulary."""
    draw = random.Random(seed)
    return [" ".join(draw.choice(WORDS) for _ in range(words)) for _ in range(count)]
