"""What one rank of a DeepSpeed AutoTP engine (tensor_parallel.autotp_size 2, ZeRO stage 0, float32) does
with tiled MLPs and the tiled loss: each attempt's outcome, as (error class name, message), or "ran"."""
from __future__ import annotations

from typing import Dict, Tuple

import torch

TOKENS = 23
HIDDEN = 16
VOCAB = 64


def tiny_llama() -> torch.nn.Module:
    """Two key-value heads, so that AutoTP splits attention evenly over 2 ranks too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=64))
    model.set_attn_implementation("eager")
    return model


def autotp_engine(model: torch.nn.Module):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "tensor_parallel": {"autotp_size": 2},
        "zero_allow_untested_optimizer": True,  # a plain torch SGD
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    return engine


def _outcome(attempt) -> Tuple[str, str]:
    try:
        attempt()
    except Exception as error:  # noqa: BLE001 - the outcome is what is recorded
        return type(error).__name__, str(error)
    return "ran", ""


def tiled_blocks_under_autotp(rank: int, world_size: int) -> Dict[str, object]:
    import tiled_mlp

    model = tiny_llama()
    tiled_mlp.apply_tiled_mlp(model, num_shards=3)  # before initialize: AutoTP then replaces the Linears inside
    engine = autotp_engine(model)
    mlp = engine.module.model.layers[0].mlp
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    hidden = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    return {
        "mlp_layers": {name: type(child).__name__ for name, child in mlp.named_children()},
        "head_layer": type(engine.module.lm_head).__name__,
        "mlp": _outcome(lambda: mlp(torch.randn(1, TOKENS, HIDDEN, requires_grad=True))),
        "mlp_last_path": mlp.tiling.last_path,
        "loss": _outcome(lambda: tiled_mlp.tiled_cross_entropy(hidden, engine.module.lm_head, ids, num_shards=2)),
    }
