"""Rank-side half of the DCP resume test: save a checkpoint (model + optimizer state, keyed by FQN)
from one FSDP2 run and resume it in another, untiled <-> tiled.

``save_runs`` trains each kind for ``SAVE_AT`` AdamW steps, ``dcp.save``s it, then goes on for
``CONTINUE`` steps: that continuation is what a resumed run must reproduce. ``resume_runs`` builds
the *other* kind from a different seed (so a tensor the load missed shows up), loads the checkpoint
and trains the same continuation steps.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tiled_mlp import TiledMLP

from .comparison import full_tensor
from .toy_models import make_toy_model

HIDDEN = 16  # toy_models.ToyModel's hidden size
TOKENS = 24  # 3 shards of 8 tokens
NUM_SHARDS = 3
SAVE_AT = 2  # steps trained before the checkpoint
CONTINUE = 2  # steps trained after it (reference continuation and resumed runs)
KINDS = ("untiled", "tiled")
LR = 1e-2


def build_for_resume(kind: str, seed: int, world_size: int, lr: float = LR):
    """The toy model, TiledMLP on each block's MLP when tiled (before FSDP2), each block and the
    root under ``fully_shard``, and AdamW over all parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_toy_model(seed=seed, tiled=kind == "tiled", num_shards=NUM_SHARDS)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return model, optimizer


def resume_batch(rank: int, step: int):
    """Fixed per rank and step, the same in every run."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(1, TOKENS, HIDDEN, generator=g)
    return x, torch.randn(x.shape, generator=g)


def train_for_resume(model: nn.Module, optimizer, rank: int, steps: range) -> list:
    """The rank's local loss at each step (before that step's update)."""
    losses = []
    for step in steps:
        x, target = resume_batch(rank, step)
        loss = ((model(x) - target) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: full_tensor(p) for name, p in model.named_parameters()}


def full_optim_state(osd: dict) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{fqn: {exp_avg, exp_avg_sq, step}}`` as whole tensors, from a (sharded) optimizer state dict."""
    return {fqn: {k: full_tensor(v) for k, v in sorted(osd["state"][fqn].items())} for fqn in sorted(osd["state"])}


def describe(model: nn.Module, osd: dict) -> dict:
    """The names a checkpoint is keyed by: what must not depend on tiling."""
    return {
        "parameters": [n for n, _ in model.named_parameters()],
        "modules": [n for n, _ in model.named_modules()],
        "optim_state": sorted(osd["state"]),
        "optim_groups": [g["params"] for g in osd["param_groups"]],
        "tiled_modules": sum(isinstance(m, TiledMLP) for m in model.modules()),
    }


def save_runs(rank: int, world_size: int, ckpt_root: str) -> dict:
    out = {}
    for kind in KINDS:
        model, optimizer = build_for_resume(kind, seed=0, world_size=world_size)
        train_for_resume(model, optimizer, rank, range(SAVE_AT))
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        record = describe(model, state["optim"])
        record["model_keys"] = sorted(state["model"])
        # Gathered before training goes on: the state dict shares storage with the live tensors.
        record["saved_params"] = full_params(model)
        record["saved_optim"] = full_optim_state(state["optim"])
        dcp.save(state, checkpoint_id=str(Path(ckpt_root) / kind))
        record["losses"] = train_for_resume(model, optimizer, rank, range(SAVE_AT, SAVE_AT + CONTINUE))
        record["final"] = full_params(model)
        out[kind] = record
    return out


def resume_runs(rank: int, world_size: int, ckpt_root: str) -> dict:
    """``{saved_kind: record}``: each checkpoint resumed into the other kind."""
    out = {}
    for saved, kind in zip(KINDS, reversed(KINDS), strict=True):
        # Another seed and another lr: the checkpoint must bring every tensor and the param_groups.
        model, optimizer = build_for_resume(kind, seed=1, world_size=world_size, lr=10 * LR)
        # get_optimizer_state_dict gives AdamW its state tensors (a zero-grad step) so there is
        # something for dcp.load to fill. Sharded tensors are filled in place (they are the live
        # DTensors); the param_groups' plain values (lr) reach the optimizer only through
        # set_optimizer_state_dict.
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(Path(ckpt_root) / saved))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        record = describe(model, get_optimizer_state_dict(model, optimizer))
        record["loaded_params"] = full_params(model)
        record["loaded_optim"] = full_optim_state(get_optimizer_state_dict(model, optimizer))
        record["losses"] = train_for_resume(model, optimizer, rank, range(SAVE_AT, SAVE_AT + CONTINUE))
        record["final"] = full_params(model)
        out[saved] = record
    return out
