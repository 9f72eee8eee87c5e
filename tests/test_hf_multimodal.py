"""A multimodal model: Qwen2.5-VL's text MLP and its vision tower's MLP (gated, with bias, called on
``[patches, hidden]``) are both tiled; an image+text step matches the untiled model in float64."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from integration_tests.tiny_models import grads_by_key, tiny_qwen2_5_vl  # noqa: E402
from tiled_mlp.integrations import apply_tiled_mlp  # noqa: E402


@pytest.mark.timeout(60)
def test_qwen2_5_vl_text_and_vision_mlps_tiled_match_untiled():
    reference = tiny_qwen2_5_vl()
    tiled = copy.deepcopy(reference)
    report = apply_tiled_mlp(tiled, num_shards=3)
    assert sorted(b.name for b in report.patched) == ["model.language_model.layers.0.mlp", "model.visual.blocks.0.mlp"]

    generator = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])  # two images of 16 patches, 4 tokens each after merging
    pixels = torch.randn(32, 3 * 2 * 2, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, 60, (2, 13), generator=generator)
    ids[:, 2:6] = 60  # the image tokens
    outs = [m(input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid) for m in (reference, tiled)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-10, atol=1e-12)
    want, got = grads_by_key(reference), grads_by_key(tiled)
    for key, want_grad in want.items():
        assert want_grad is not None and got[key] is not None, key
        torch.testing.assert_close(got[key], want_grad, rtol=1e-9, atol=1e-12, msg=key)
    assert want["model.visual.blocks.0.mlp.up_proj.bias"].abs().max() > 0  # the image reached the vision MLP
    assert report.paths() == {"model.visual.blocks.0.mlp": "fast", "model.language_model.layers.0.mlp": "fast"}
    assert all(b.tiled.tiling.last_num_shards == 3 for b in report.patched)
