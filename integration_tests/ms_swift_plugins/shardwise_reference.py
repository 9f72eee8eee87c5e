"""An ``--external_plugins`` file for the ms-swift test: the untiled reference that draws the tiled run's dropout
masks. Each MLP block runs its own forward (no tiling, plain autograd) on the token shards of the tiled run's plan,
one after another: the random numbers are drawn in the tiled forward's order, so with dropout on the two runs
differ only by rounding if the tiled backward replays each shard's masks. ``SHARDWISE_REFERENCE_SHARDS`` gives
the shard count."""
import functools
import os

import torch
from swift.pipelines.train.sft import SwiftSft

from tiled_mlp.core.shard_plan import make_shard_plan

NUM_SHARDS = int(os.environ["SHARDWISE_REFERENCE_SHARDS"])


def _shardwise(forward):
    @functools.wraps(forward)
    def run(x):
        flat = x.reshape(-1, x.shape[-1])
        shards = [forward(flat[s]) for s in make_shard_plan(flat.shape[0], NUM_SHARDS).slices()]
        return torch.cat(shards).view(*x.shape[:-1], -1)

    return run


_original = SwiftSft.prepare_model.__func__


def _prepare_model(cls, args, model, *rest, **options):
    model = _original(cls, args, model, *rest, **options)
    blocks = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    assert len(blocks) == 2, [name for name, _ in model.named_modules() if name.endswith(".mlp")]
    for block in blocks:
        block.forward = _shardwise(block.forward)
    print(f"shardwise reference: {len(blocks)} MLP block(s) in {NUM_SHARDS} shards", flush=True)
    return model


SwiftSft.prepare_model = classmethod(_prepare_model)
