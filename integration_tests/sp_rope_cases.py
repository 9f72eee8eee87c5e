"""Ulysses SP with a RoPE whose frequencies follow the sequence's length (``ulysses_rope``): the models,
the calls, the rank-side runs and the single-process float64 reference.

Each model goes through ``apply_long_context(model, sequence_parallel=2)`` (tiled MLP, loss and norms,
checkpoint offload, SP) and makes a forward and backward at each length of ``LENGTHS`` in turn, on the
same weights; the reference is the same model untiled, without SP, in one process, making the same calls
(Hugging Face's dynamic RoPE keeps state between calls: the longest length seen).
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from .sp_cases import hf_loss64
from .tiny_models import _COMMON, VOCAB

TRAINED = 16  # the length the length-dependent types were "trained" at; past it they scale
# Past the trained length (dynamic grows to 32), shorter than the longest seen (kept), below the trained
# length (reset), longer again (grows to 40). Rank 0's slice of the first call ends at 16: unscaled.
LENGTHS = (32, 24, 8, 40)
MODELS = ("llama-plain", "llama-dynamic", "phi3-longrope", "gemma3-dynamic")


def build_rope_model(name: str) -> torch.nn.Module:
    """The float64 model, seeded, sdpa attention (DeepSpeed's SP refuses eager)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(_COMMON, max_position_embeddings=TRAINED)
    if name == "llama-plain":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif name == "llama-dynamic":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                         "rope_theta": 10000.0}))
    elif name == "phi3-longrope":
        # Phi-3-128k / Phi-3.5 style: max_position_embeddings past original_max_position_embeddings, no factor.
        longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3],
                    "long_factor": [1.5, 2.0, 3.0, 4.0], "original_max_position_embeddings": TRAINED}
        model = Phi3ForCausalLM(Phi3Config(**dict(common, num_key_value_heads=2, max_position_embeddings=4 * TRAINED),
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                           original_max_position_embeddings=TRAINED, rope_parameters=longrope))
    elif name == "gemma3-dynamic":
        # One rotary embedding, one rope_type per layer type (called with the layer type as a positional
        # argument): dynamic on the full-attention layer, plain on the sliding one.
        per_layer = {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=8, sliding_window=8, rope_parameters=per_layer,
                                                   layer_types=["sliding_attention", "full_attention"]))
    else:
        raise ValueError(name)
    model = model.to(torch.float64)
    model.set_attn_implementation("sdpa")
    return model


def rope_sample(tokens: int, call: int):
    g = torch.Generator().manual_seed(100 + call)
    ids = torch.randint(0, VOCAB, (1, tokens), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return ids, labels


def rope_reference(name: str) -> List[Dict]:
    """Per call: the loss and every gradient, one process, untiled, without SP."""
    model = build_rope_model(name)
    out = []
    for call, tokens in enumerate(LENGTHS):
        ids, labels = rope_sample(tokens, call)
        loss = hf_loss64(model(input_ids=ids).logits, labels)
        loss.backward()
        out.append({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        model.zero_grad()
    return out


def run_ranks(rank: int, world: int) -> Dict[str, List[Dict]]:
    """Per model, per call: this rank's loss and the gradients averaged over the ranks (what DDP would
    hand the optimizer: each rank's share of the whole sequence's gradient, times the group size)."""
    from tiled_mlp.integrations import apply_long_context

    out: Dict[str, List[Dict]] = {}
    for name in MODELS:
        model = build_rope_model(name)
        model.train()
        stack = apply_long_context(model, sequence_parallel=2)
        sp = stack.sequence_parallel
        calls = []
        for call, tokens in enumerate(LENGTHS):
            ids, labels = rope_sample(tokens, call)
            loss = model(**sp.shard({"input_ids": ids, "labels": labels})).loss
            loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                grads[n] = p.grad.detach().clone()
                dist.all_reduce(grads[n])
                grads[n] /= world
            calls.append({"loss": loss.detach(), "grads": grads})
            model.zero_grad()
        stack.remove()
        out[name] = calls
    return out
