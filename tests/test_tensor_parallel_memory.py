"""The modelled memory of one tensor-parallel rank (``tiled-mlp bench --model-memory --tp N``): its local
weights and its collectives' buffers, untiled against the tiled kernel on the same local weights."""
from __future__ import annotations

import pytest

from tiled_mlp.bench.model_memory import modeled_step

HIDDEN, INTERMEDIATE, TOKENS = 512, 1792, 16384


def test_tiled_tensor_parallel_rank_peaks_far_below_the_untiled_rank():
    untiled = modeled_step("untiled", HIDDEN, INTERMEDIATE, TOKENS, tp=2)[0]
    tiled, shards = modeled_step("auto", HIDDEN, INTERMEDIATE, TOKENS, num_shards="auto", tp=2)
    assert shards > 1 and tiled <= 0.55 * untiled, (tiled, untiled, shards)
    # A rank holds at least the plain MLP on its local weights.
    assert untiled >= modeled_step("untiled", HIDDEN, INTERMEDIATE // 2, TOKENS)[0]


def test_tensor_parallel_model_needs_a_divisible_intermediate_size():
    with pytest.raises(ValueError, match="divisible by 3"):
        modeled_step("untiled", HIDDEN, INTERMEDIATE, 64, tp=3)
