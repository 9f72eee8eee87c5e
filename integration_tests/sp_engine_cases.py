"""A model trained under a DeepSpeed engine, the engine destroyed, then trained again under SP with
another backend: the rank-side run. The destroyed engine must not answer how gradients are reduced, and a
live engine beside FSDP2 on the same model is refused."""
from __future__ import annotations

from typing import Dict

import torch

from .sp_backend_cases import _raised, sp_ds_config, sp_llama


def destroyed_engine_runs(rank: int, world: int) -> Dict:
    import deepspeed
    from torch.distributed.fsdp import fully_shard

    from tiled_mlp.strategies.deepspeed_sp import deepspeed_sums_over_sequence_ranks, engines_of

    model, sp = sp_llama(torch.float32)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=sp_ds_config(1), mpu=sp.mpu)
    out: Dict = {"live_sums": deepspeed_sums_over_sequence_ranks(model, sp.group)}
    fully_shard(model.lm_head)  # FSDP2 on a part of the model while the engine lives
    out["live_beside_fsdp2"] = _raised(lambda: deepspeed_sums_over_sequence_ranks(model, sp.group))
    engine.destroy()
    sp.remove()
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    sp = apply_sequence_parallel(model, 2)  # SP again, no DeepSpeed engine: another backend trains it
    out["engines_after_destroy"] = len(engines_of(model))
    out["sums_after_destroy"] = deepspeed_sums_over_sequence_ranks(model, sp.group)
    sp.remove()
    return out
