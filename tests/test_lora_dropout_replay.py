"""PEFT LoRA with dropout (ms-swift's default LoRA, ``lora_dropout=0.05``) inside a tiled MLP, float64.

The tiled forward draws each dropout mask shard by shard, so its masks are not the untiled call's: the
reference that draws the same masks is the untiled module applied to the same token shards one after
another from the same seed. The backward's recompute must replay each shard's own masks, so that the
gradients are those of the forward that ran.
"""
from __future__ import annotations

import copy

import pytest
import torch
from reference import (
    GatedMLP,
    assert_runs_close,
    fresh_inputs,
    run_errors,
    tiled_run,
    untiled_run,
    untiled_shardwise_run,
)

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER = 8, 12
TOKENS = 7  # prime: the shards are uneven for every count in 2..6
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def lora_mlp(dropout: float, seed: int = 0) -> torch.nn.Module:
    """A gated MLP with PEFT LoRA on all three projections (B initialised non-zero, so the adapters act)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                             target_modules=list(PROJECTIONS))
    return peft.inject_adapter_in_model(config, GatedMLP(HIDDEN, INTER)).double().train()


def dropout_modules(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]


@pytest.mark.parametrize("num_shards", [2, 3, 7])
def test_tiled_lora_dropout_equals_the_shardwise_reference_with_the_same_masks(num_shards):
    mlp = lora_mlp(dropout=0.3)
    assert len(dropout_modules(mlp)) == 3
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN, seed=5)
    got, tiled = tiled_run(mlp, x, dy, seed=42, num_shards=num_shards)
    assert tiled.tiling.last_path == "generic"
    assert_runs_close(untiled_shardwise_run(mlp, x, dy, num_shards, seed=42), got, tol=1e-12,
                      context=f"{num_shards} shards")
    lora_grads = [g for n, g in got.grads.items() if "lora_" in n]
    assert len(lora_grads) == 6 and all(g is not None and g.abs().max() > 0 for g in lora_grads)


@pytest.mark.parametrize("num_shards", [2, 3])
def test_per_shard_masks_are_not_the_untiled_masks(num_shards):
    """Why a tiled run with dropout drifts from the untiled one: other random draws, not other maths.
    One shard draws as the untiled call does; more shards draw the three projections' masks in another
    order (shard 0's gate, up, down, then shard 1's ...), so outputs and gradients differ."""
    mlp = lora_mlp(dropout=0.3)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN, seed=6)
    one, _ = tiled_run(mlp, x, dy, seed=7, num_shards=1)
    torch.manual_seed(7)
    assert_runs_close(untiled_run(mlp, x, dy), one, tol=1e-12)
    many, _ = tiled_run(mlp, x, dy, seed=7, num_shards=num_shards)
    torch.manual_seed(7)
    assert max(run_errors(untiled_run(mlp, x, dy), many).values()) > 1e-3


def test_recompute_replays_each_shards_own_masks():
    """The masks seen in the backward's recompute are, shard for shard, the masks the forward drew."""
    num_shards = 3
    tiled = copy.deepcopy(lora_mlp(dropout=0.5))
    masks: list = []
    for module in dropout_modules(tiled):
        # Plain values, not tensors: the tiled forward refuses a hook that keeps its shard's tensors.
        module.register_forward_hook(lambda mod, args, out: masks.append(((out == 0) & (args[0] != 0)).tolist()))
    from tiled_mlp import TiledMLP

    tiled = TiledMLP(tiled, num_shards=num_shards)
    x, dy = fresh_inputs((1, TOKENS, HIDDEN), HIDDEN, seed=8)
    torch.manual_seed(3)
    out = tiled(x)
    forward_masks = list(masks)
    assert len(forward_masks) == 3 * num_shards
    masks.clear()
    out.backward(dy)
    assert len(masks) == len(forward_masks), "the recompute did not run every shard's dropout"
    for index, (drawn, replayed) in enumerate(zip(forward_masks, masks, strict=True)):
        assert torch.tensor(drawn).any(), "dropout dropped nothing: the test could not see another mask"
        assert drawn == replayed, f"call {index}: the recompute drew another mask"
