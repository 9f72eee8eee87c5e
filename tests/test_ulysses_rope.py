"""Which RoPE types follow the sequence's length (``ulysses_rope``), decided by what transformers does, and
the refusals that need no process group. The SP runs themselves: ``integration_tests/test_sp_rope.py``."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRotaryEmbedding  # noqa: E402

from tiled_mlp.integrations.ulysses_rope import (  # noqa: E402
    LENGTH_DEPENDENT,
    LENGTH_INDEPENDENT,
    is_length_dependent,
    length_dependent_rotaries,
    whole_sequence_rope,
)

TRAINED = 16  # max_position_embeddings: the length past which the length-dependent types scale
# The parameters each registered type needs (head_dim 8: 4 frequencies).
PARAMS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 2.0, "original_max_position_embeddings": TRAINED // 2},
    "longrope": {"short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.5, 2.0, 3.0, 4.0],
                 "original_max_position_embeddings": TRAINED},
    "llama3": {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": TRAINED // 2},
    "proportional": {"partial_rotary_factor": 0.5},
}


def _rope_config(rope_type: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=TRAINED,
                       rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **PARAMS[rope_type]})


def test_every_registered_rope_type_is_classified():
    """A release that registers a new type fails here until it is read and put in one of the tables."""
    assert set(LENGTH_DEPENDENT).isdisjoint(LENGTH_INDEPENDENT)
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(LENGTH_DEPENDENT) | set(LENGTH_INDEPENDENT)
    assert set(PARAMS) == set(LENGTH_DEPENDENT) | set(LENGTH_INDEPENDENT)
    for rope_type in LENGTH_DEPENDENT:
        assert is_length_dependent(rope_type)
    for rope_type in LENGTH_INDEPENDENT:
        assert not is_length_dependent(rope_type)


@pytest.mark.parametrize("rope_type", sorted(PARAMS))
def test_the_classification_is_what_transformers_computes(rope_type):
    """A slice's positions (the first 8, what SP rank 0 holds of 32 tokens) get the cos/sin the whole
    sequence gives them exactly where the type is classified length-independent, and other ones where it
    is classified length-dependent (the whole sequence runs past the trained length)."""
    config = _rope_config(rope_type)
    x = torch.zeros(1, 32, 16, dtype=torch.float64)
    positions = torch.arange(32)[None]
    whole = LlamaRotaryEmbedding(config)(x, positions)
    part = LlamaRotaryEmbedding(config)(x[:, :8], positions[:, :8])
    same = all(torch.equal(w[:, :8], p) for w, p in zip(whole, part, strict=True))
    assert same != is_length_dependent(rope_type), (rope_type, same)


def _rope_model(rope_type: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(_rope_config(rope_type))


@pytest.mark.parametrize("rope_type", sorted(PARAMS))
def test_the_rotaries_sp_hooks(rope_type):
    found = length_dependent_rotaries(_rope_model(rope_type))
    assert [type(m) for m in found] == ([LlamaRotaryEmbedding] if is_length_dependent(rope_type) else [])


class OwnRotary(LlamaRotaryEmbedding):
    """A rotary embedding whose forward is its own, not transformers' ``dynamic_rope_update``."""

    def forward(self, x, position_ids):
        return super().forward(x, position_ids)


def test_a_length_dependent_rotary_with_its_own_forward_is_refused():
    model = _rope_model("dynamic")
    model.model.rotary_emb = OwnRotary(model.config)
    with pytest.raises(ValueError, match="OwnRotary has the length-dependent rope_type 'dynamic'.*dynamic_rope_update"):
        length_dependent_rotaries(model)
    plain = _rope_model("default")
    plain.model.rotary_emb = OwnRotary(plain.config)
    assert length_dependent_rotaries(plain) == []  # a length-independent type: nothing to give it


def test_a_config_asking_for_a_length_dependent_type_without_its_rotary_is_refused():
    model = _rope_model("longrope")
    model.model.rotary_emb.rope_type = "default"  # the module no longer carries it
    with pytest.raises(ValueError, match="asks for the length-dependent rope_type 'longrope'"):
        length_dependent_rotaries(model)


def test_a_rotary_called_without_position_ids_is_refused_before_any_collective():
    rotary = LlamaRotaryEmbedding(_rope_config("dynamic"))
    handles = whole_sequence_rope([rotary], group=None)
    try:
        with pytest.raises(ValueError, match="called without position_ids"):
            rotary(torch.randn(1, 8, 16))
    finally:
        for handle in handles:
            handle.remove()
