"""Tiny random-weight transformers models, one per covered family, built locally (no downloads).

Used by the tests and demos: hidden 16-32, 1-2 layers, vocab 64, so a float64 forward and backward
takes milliseconds. Each entry also says which path its MLP blocks should take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], torch.nn.Module]  # a causal LM on random weights
    expected_path: str  # the path the text MLP blocks take at the first forward
    blocks: int  # how many blocks apply_tiled_mlp tiles


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_COMMON))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=8))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_COMMON))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=8))


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(**_COMMON, head_dim=8, hidden_act="gelu_pytorch_tanh",
                                        hidden_activation="gelu_pytorch_tanh"))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**_COMMON, head_dim=8, sliding_window=8,
                                          hidden_activation="gelu_pytorch_tanh"))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_COMMON, head_dim=8, sliding_window=8))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = dict(_COMMON, num_key_value_heads=2)
    return Phi3ForCausalLM(Phi3Config(**config, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Layer 0 sparse (4 experts, top 2), layer 1 a dense MLP: both kinds of block in one model.
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=24, decoder_sparse_step=1,
                                              mlp_only_layers=[1], norm_topk_prob=True))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2))


FAMILIES: Dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", _llama, "fast", 2),
        Family("mistral", _mistral, "fast", 2),
        Family("qwen2", _qwen2, "fast", 2),
        Family("qwen3", _qwen3, "fast", 2),
        Family("gemma", _gemma, "fast", 2),
        Family("gemma2", _gemma2, "fast", 2),
        Family("gemma3", _gemma3, "fast", 2),
        Family("phi3", _phi3, "fast", 2),
        Family("qwen3_moe", _qwen3_moe, "mixed", 2),
        Family("mixtral", _mixtral, "generic", 2),
    )
}


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The family's tiny causal LM with seeded weights, in ``dtype``, eager attention and experts."""
    torch.manual_seed(seed)
    model = FAMILIES[family].build().to(dtype)
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        # The default grouped_mm expert kernel takes no float64.
        model.set_experts_implementation("eager")
    return model


def grads_by_key(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``state_dict`` key -> gradient (None where there is none); the keys are the same tiled or not."""
    return {key: (t.grad if isinstance(t, torch.nn.Parameter) else None)
            for key, t in model.state_dict(keep_vars=True).items()}


def token_ids(seed: int = 0, batch: int = 2, seq: int = 13) -> torch.Tensor:
    """Seeded token ids of shape (batch, seq)."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def token_batch(seed: int = 0, batch: int = 2, seq: int = 11, masked: int = 3) -> Tuple[torch.Tensor, torch.Tensor]:
    """Seeded token ids and their labels, the first ``masked`` labels of the first sample -100: uneven
    masks, so that a mean over valid tokens differs from a mean over positions."""
    ids = token_ids(seed, batch, seq)
    labels = ids.clone()
    labels[0, :masked] = -100
    return ids, labels


class TokenRows(torch.utils.data.Dataset):
    """Rows of token ids and their labels (the ids themselves unless given): a Trainer's dataset."""

    def __init__(self, ids, labels=None):
        self.ids, self.labels = ids, (ids if labels is None else labels)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def tiny_qwen2_5_vl(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """Qwen2.5-VL with a one-block vision tower (gated MLP with bias) and a one-layer text model.
    Token ids 60-63 are the image/video/vision start/end tokens; a 4x4 patch grid merges to 4 tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(_COMMON, num_hidden_layers=1, bos_token_id=0, eos_token_id=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=16, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=1, window_size=8, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=60, video_token_id=61,
                              vision_start_token_id=62, vision_end_token_id=63)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
    model.set_attn_implementation("eager")
    return model


def planner_llama(layers: int = 3, *, intermediate: int = 352, vocab: int = 512, positions: int = 4096) -> Any:
    """A LlamaConfig of hidden size 64, 4 attention and 2 key-value heads (2 ranks of SP or TP take 2 and 1):
    the planner tests' dense model."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions)


def planner_mixed_moe(layers: int = 12) -> Any:
    """MoE on every second layer, and layer 5 (which would be MoE) dense: three kinds of spacing."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, intermediate_size=192, moe_intermediate_size=32, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, vocab_size=512, max_position_embeddings=8192,
                          decoder_sparse_step=2, mlp_only_layers=[5])


def small_planner_llama(layers: int = 4, positions: int = 4096) -> Any:
    """planner_llama with half its MLP (176) and vocabulary (256): the attention, composition, RNG and
    side-by-side tests. Four alike layers by default: composed from the 2- and 3-layer steps."""
    return planner_llama(layers, intermediate=176, vocab=256, positions=positions)
