"""The refusals of Ulysses SP's whole-sequence masks that need no process group: what a config shows
when SP is applied (``check_masks``), and what the inner attention refuses at each call."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiled_mlp.integrations.ulysses_masks import (  # noqa: E402
    WHOLE_SEQUENCE_KWARG,
    WholeSequence,
    attention_kind,
    check_masks,
    whole_sequence_attention,
)


def _mistral_config():
    return transformers.MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                      sliding_window=4)


def test_core_kind_is_read_from_the_library_function():
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert [attention_kind(f) for f in (sdpa_attention_forward, flash_attention_forward, flex_attention_forward, None)] == [
        "sdpa", "flash", "other", "other"]


def test_a_windowed_config_is_refused_where_the_core_gets_only_a_causal_mask():
    with pytest.raises(ValueError, match="without this model's sliding window \\(4 tokens\\); use sdpa"):
        check_masks(_mistral_config(), "flex_attention", "other")
    check_masks(_mistral_config(), "sdpa", "sdpa")
    check_masks(_mistral_config(), "flash_attention_2", "flash")
    # Qwen2 with its window switched off has no sliding layer: nothing to refuse.
    check_masks(transformers.Qwen2Config(use_sliding_window=False), "flex_attention", "other")


@pytest.mark.parametrize("overrides, words", [
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layers of type \\['chunked_attention'\\]"),
    ({"attention_chunk_size": 8}, "chunked attention"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ({"is_causal": False}, "bidirectional attention"),
])
def test_masks_sp_does_not_rebuild_are_refused(overrides, words):
    config = transformers.LlamaConfig(num_hidden_layers=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=words):
        check_masks(config, "sdpa", "sdpa")


def _qkv():
    return [torch.zeros(1, 1, 8, 4) for _ in range(3)]


def test_the_core_refuses_a_call_without_the_whole_sequence():
    attention = whole_sequence_attention(lambda *a, **k: None, "sdpa", transformers.LlamaConfig())
    with pytest.raises(RuntimeError, match="without the whole sequence's padding"):
        attention(torch.nn.Module(), *_qkv(), None, position_ids=torch.arange(8)[None])


def test_the_core_refuses_a_window_it_cannot_place():
    attention = whole_sequence_attention(lambda *a, **k: None, "sdpa", _mistral_config())
    whole = {WHOLE_SEQUENCE_KWARG: WholeSequence(padding=None, cached=True)}
    with pytest.raises(RuntimeError, match="does not pass its sliding_window"):
        attention(torch.nn.Module(), *_qkv(), None, **whole)
    with pytest.raises(RuntimeError, match="sliding_window \\(3\\) is not the config's \\(4\\)"):
        attention(torch.nn.Module(), *_qkv(), None, sliding_window=3, **whole)


def test_the_core_passes_hf_sliding_mask_to_sdpa():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    seen = {}
    config = _mistral_config()
    config._attn_implementation = "sdpa"
    attention = whole_sequence_attention(lambda module, q, k, v, mask, **kw: seen.update(mask=mask, kwargs=kw), "sdpa", config)
    attention(torch.nn.Module(), *_qkv(), None, sliding_window=4, **{WHOLE_SEQUENCE_KWARG: WholeSequence(padding=None, cached=True)})
    want = sdpa_mask(1, 8, 8, mask_function=sliding_window_causal_mask_function(4), allow_is_causal_skip=False)
    assert torch.equal(seen["mask"], want) and WHOLE_SEQUENCE_KWARG not in seen["kwargs"]


def test_the_core_refuses_when_no_layer_said_whether_the_decoder_holds_a_cache():
    attention = whole_sequence_attention(lambda *a, **k: None, "sdpa", transformers.LlamaConfig())
    with pytest.raises(RuntimeError, match="reported whether the decoder holds a cache"):
        attention(torch.nn.Module(), *_qkv(), None, position_ids=torch.arange(8)[None],
             **{WHOLE_SEQUENCE_KWARG: WholeSequence(padding=None)})


def test_the_core_refuses_a_call_without_position_ids():
    # Without them HF's mask cannot tell packed samples apart: refused, not built as one causal row.
    attention = whole_sequence_attention(lambda *a, **k: None, "sdpa", transformers.LlamaConfig())
    for missing in ({}, {"position_ids": None}):
        with pytest.raises(RuntimeError, match="got no position_ids"):
            attention(torch.nn.Module(), *_qkv(), None, **missing,
                      **{WHOLE_SEQUENCE_KWARG: WholeSequence(padding=None, cached=False)})
