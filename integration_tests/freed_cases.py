"""What each rank of ``test_freed_on_delete_distributed.py`` runs: a model under DDP, or under Ulysses SP through
``apply_long_context``, one training step, then ``del`` with the collector off: is it freed by reference counts?"""
from __future__ import annotations

import gc
import weakref
from typing import Dict

import torch

from .tiny_models import FAMILIES, token_ids

TOKENS = 16  # 8 per rank under SP of 2


def _step(case: str, rank: int, world: int) -> Dict[str, bool]:
    """Builds, trains a step, deletes; returns which of (model, an MLP weight) are still alive."""
    from torch.nn.parallel import DistributedDataParallel

    from tiled_mlp import apply_long_context, apply_tiled_mlp

    torch.manual_seed(0)
    model = FAMILIES["llama"].build()  # sdpa attention, as DeepSpeed's SP needs
    model.train()
    ids = token_ids(seed=0, batch=1, seq=TOKENS)
    batch = {"input_ids": ids, "labels": ids}
    stack = wrapper = None
    if case.startswith("sp"):
        stack = apply_long_context(model, sequence_parallel=world, checkpoint_offload=False, num_shards=2,
                                   loss_num_shards=2)
        assert stack.sequence_parallel is not None
        batch = stack.sequence_parallel.shard(batch)
        model(**batch).loss.backward()
        if case == "sp_removed":
            stack.remove()
    else:
        if case == "ddp_tiled":
            apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
        wrapper = DistributedDataParallel(model)
        wrapper(**batch).loss.backward()
    refs = weakref.ref(model), weakref.ref(model.model.layers[0].mlp.up_proj.weight)
    del model, wrapper, stack
    return {"model": refs[0]() is not None, "weight": refs[1]() is not None}


def freed_after_delete(rank: int, world: int) -> Dict[str, Dict[str, bool]]:
    was_enabled = gc.isenabled()
    results = {}
    # "sp_kept" last: SP left on keeps DeepSpeed's process-wide groups, and a second SP would be refused.
    for case in ("ddp_untiled", "ddp_tiled", "sp_removed", "sp_kept"):
        gc.collect()
        gc.disable()
        try:
            results[case] = _step(case, rank, world)
        finally:
            if was_enabled:
                gc.enable()
        gc.collect()
    from tiled_mlp.integrations.seams import deepspeed_internals

    deepspeed_internals.release_sp_groups()  # what "sp_kept" left: the process group ends without waiting on them
    return results
