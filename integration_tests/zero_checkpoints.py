"""Rank-side half of test_zero_checkpoints: train under DeepSpeed ZeRO, tiled and untiled, then export
the weights the ways users do (consolidated 16-bit state dict, ``save_checkpoint`` + ``zero_to_fp32``,
HF ``Trainer.save_model``) and hand the exports back, with the trained weights to compare them to.

Trained weights are keyed by the model's ``state_dict`` keys, which are the untiled names whether the
model is tiled or not; the exports are keyed however DeepSpeed names them (from ``named_parameters``), which
is what the tests check.
"""
from __future__ import annotations

import logging
from typing import Dict

import torch
import torch.distributed as dist

from tiled_mlp import TiledMLP, apply_tiled_mlp

from .toy_models import make_toy_model
from .zero_cases import ZeroCase, zero_ds_config
from .zero_training import full_param, zero_micro_batch

SHARDS = 3  # the toy model's 24 tokens per rank: 3 shards of 8, so tiling really runs
LR = 0.1  # SGD, so one step visibly moves every weight


def last_num_shards(tiled: torch.nn.Module):
    """The shard count of the block's last call, checked so that a run that silently did not tile fails."""
    return tiled.tiling.last_num_shards


def trained_by_key(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Full fp32 value of every parameter, gathered from its ZeRO partitions, by ``state_dict`` key."""
    return {key: full_param(p) for key, p in model.state_dict(keep_vars=True).items()}


def checkpoint_to_fp32(engine, directory: str, rank: int):
    """``save_checkpoint`` on every rank (each writes its partition), then ``zero_to_fp32`` on rank 0."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine.save_checkpoint(directory)
    dist.barrier()  # every rank's optimizer partition is on disk before rank 0 reads them
    return dict(get_fp32_state_dict_from_zero_checkpoint(directory)) if rank == 0 else None


def export_toy(rank: int, stage: int, tiled: bool, directory: str) -> Dict:
    import deepspeed

    model = make_toy_model(seed=0)
    blocks = []
    for layer in model.layers:
        # Assigned back as a wrapper API is called; tiling in place makes the assignment a no-op.
        layer.mlp = TiledMLP(layer.mlp, num_shards=SHARDS) if tiled else layer.mlp
        blocks.append(layer.mlp)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=zero_ds_config(ZeroCase(f"z{stage}-export", stage=stage)))
    x, target = zero_micro_batch(ZeroCase("data"), rank, 0)  # 24 tokens, different on each rank
    engine.backward(((engine(x) - target) ** 2).mean())
    engine.step()
    out = {"trained": trained_by_key(model),
           "shards": [last_num_shards(m) for m in blocks] if tiled else None}
    if stage == 3:
        consolidated = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls it
        out["consolidated"] = dict(consolidated) if rank == 0 else None
    out["fp32"] = checkpoint_to_fp32(engine, directory, rank)
    engine.destroy()
    return out


def export_toy_all(rank: int, world_size: int, root: str) -> Dict:
    """``{stage: {"untiled": export, "tiled": export}}`` for ZeRO-2 and ZeRO-3, in one spawn."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    initial = {k: v.clone() for k, v in make_toy_model(seed=0).state_dict().items()}
    runs = {stage: {kind: export_toy(rank, stage, kind == "tiled", f"{root}/z{stage}-{kind}")
                    for kind in ("untiled", "tiled")}
            for stage in (3, 2)}
    return {"initial": initial, "runs": runs}


# -- HF Trainer ---------------------------------------------------------------------------------------
TRAINER_SHARDS, TRAINER_STEPS, TRAINER_LR = 2, 2, 2.0  # large: every weight, norms included, moves clearly


def trainer_ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              # what makes save_model write consolidated weights, not a ZeRO checkpoint
                              "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,  # the Trainer's torch SGD
    }


def token_dataset(n: int = 8, length: int = 12):
    from integration_tests.tiny_models import VOCAB

    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, VOCAB, (length,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids.clone()} for ids in rows]


def trainer_run(rank: int, tiled: bool, save_dir: str) -> Dict:
    from transformers import Trainer, TrainingArguments

    from integration_tests.tiny_models import tiny_model

    model = tiny_model("llama", seed=0, dtype=torch.float32)
    report = apply_tiled_mlp(model, num_shards=TRAINER_SHARDS) if tiled else None
    args = TrainingArguments(
        output_dir=f"{save_dir}-trainer", deepspeed=trainer_ds_config(), per_device_train_batch_size=2,
        max_steps=TRAINER_STEPS, learning_rate=TRAINER_LR, optim="sgd", lr_scheduler_type="constant",
        # Without use_cpu accelerate sees one process per rank on this machine (the test's docstring).
        use_cpu=True, seed=0, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
    trainer.train()
    out = {
        "trained": trained_by_key(model),
        # Evidence that the Trainer really ran ZeRO-3 across both processes:
        "accelerate": (str(trainer.accelerator.distributed_type), args.world_size, args.process_index),
        "deepspeed_world": trainer.deepspeed.dp_world_size,
        "partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
        "blocks": [(b.name, b.last_path, last_num_shards(b.tiled)) for b in report.patched]
        if tiled else None,
    }
    trainer.save_model(save_dir)  # collective: every rank joins the gather, rank 0 writes
    return out


def trainer_both(rank: int, world_size: int, root: str) -> Dict:
    """``{"untiled": run, "tiled": run}``: the same seed, data and steps, saved to ``root/<kind>``."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    return {kind: trainer_run(rank, kind == "tiled", f"{root}/{kind}") for kind in ("untiled", "tiled")}
