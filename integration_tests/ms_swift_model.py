"""A tiny Qwen2 checkpoint on local disk for ``swift sft``: random weights, a byte-level tokenizer made here (no
downloads) with the chat markers ms-swift's ``qwen2_5`` template writes, and a small chat dataset (jsonl)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from integration_tests.tiny_models import _COMMON

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SAMPLES = 8


def save_tiny_qwen2(directory: Path) -> Path:
    """Writes the checkpoint, its tokenizer and ``data.jsonl`` into ``directory``; returns the dataset's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # Byte-level BPE without merges: one token per byte (any text encodes), plus the template's markers.
    vocab = {byte: index for index, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # a set: order it
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    tokenizer.save_pretrained(directory)
    # ms-swift drops samples longer than the model's max_position_embeddings: one byte per token needs room.
    config = Qwen2Config(**dict(_COMMON, vocab_size=len(vocab), max_position_embeddings=256),
                         eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    data = directory / "data.jsonl"
    with open(data, "w") as file:
        for i in range(SAMPLES):
            answer = " ".join(str(n) for n in range(i, i + 4))
            messages = [{"role": "user", "content": f"count {i} to {i + 3}"}, {"role": "assistant", "content": answer}]
            file.write(json.dumps({"messages": messages}) + "\n")
    return data
