"""Rank-side half of the ZeRO tests: train one case under DeepSpeed and record full gradients and
parameters after every optimizer step, for the untiled model, ours, and the DeepSpeed peer."""
from __future__ import annotations

import logging
import traceback
from typing import Dict, List

import torch

from tiled_mlp import TiledMLP

from .toy_models import make_toy_model
from .training_record import new_record, note_tiled_calls
from .zero_cases import HIDDEN, LR, STEPS, ZeroCase, zero_ds_config
from .zero_peer import use_deepspeed_tiled_mlp

KINDS = ("untiled", "tiled", "peer")


def build_zero_model(case: ZeroCase, kind: str, rank: int):
    tile_kwargs = dict(num_shards=case.shards(rank), path=case.path) if kind == "tiled" else {}
    model = make_toy_model(seed=0, tiled=kind == "tiled", lora=case.lora, dtype=case.dtype, **tile_kwargs)
    if case.frozen_input:
        for p in (*model.in_proj.parameters(), *model.layers[0].norm.parameters()):
            p.requires_grad_(False)
    if kind == "peer":
        for layer in model.layers:
            use_deepspeed_tiled_mlp(layer.mlp, case.shards(rank))
    return model



def zero_micro_batch(case: ZeroCase, rank: int, index: int):
    g = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(1, case.tokens(rank), HIDDEN, generator=g).to(case.dtype)
    return x, torch.randn(x.shape, generator=g)


def full_param(p) -> torch.Tensor:
    """The whole fp32 master copy of a trained parameter; the gathered weight of a frozen one."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(p)
    if master is not None:
        return master.detach().float().clone()
    with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
        return p.detach().float().clone()


def train_zero(case: ZeroCase, kind: str, rank: int) -> Dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from tiled_mlp.core import auto_shards

    floor = auto_shards.MIN_SAVED_BYTES
    if case.min_saved_bytes is not None:
        auto_shards.MIN_SAVED_BYTES = case.min_saved_bytes
    try:
        return _train_case(case, kind, rank, deepspeed, safe_get_full_grad)
    finally:
        auto_shards.MIN_SAVED_BYTES = floor


def _train_case(case: ZeroCase, kind: str, rank: int, deepspeed, safe_get_full_grad) -> Dict:
    model = build_zero_model(case, kind, rank)
    if case.leaf_blocks:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [type(model.layers[0])])
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=LR), config=zero_ds_config(case))
    named = list(model.named_parameters())  # tiled in place: the same names as untiled
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record = new_record()
    record["initial"] = {n: full_param(p) for n, p in named}
    for step in range(STEPS):
        for micro in range(case.gas):
            x, target = zero_micro_batch(case, rank, step * case.gas + micro)
            loss = ((engine(x).float() - target) ** 2).mean()
            engine.backward(loss)
            note_tiled_calls(record, tiled)
            if micro == case.gas - 1:
                assert engine.is_gradient_accumulation_boundary()
                record["grads"].append(
                    {n: safe_get_full_grad(p).detach().float().clone() for n, p in named if p.requires_grad}
                )
            engine.step()
        record["params"].append({n: full_param(p) for n, p in named})
    engine.destroy()
    return record


def train_zero_cases(rank: int, world_size: int, cases: List[ZeroCase], kinds=("untiled", "tiled"), catch=()) -> Dict:
    """``{case.name: {kind: record}}``; kinds listed in ``catch`` record an error instead of raising."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    results = {}
    for case in cases:
        results[case.name] = {}
        for kind in kinds:
            try:
                results[case.name][kind] = train_zero(case, kind, rank)
            except Exception:  # noqa: BLE001 - only for the kinds in `catch`
                if kind not in catch:
                    raise
                results[case.name][kind] = {"error": traceback.format_exc(limit=-3)}
    return results
