"""The implementations a benchmark compares, each as ``make(mlp, num_shards) -> step_fn(x)``.

- ``untiled``: the plain module.
- ``fast`` / ``generic``: ours with the path forced; ``fast_native_act`` is ``fast`` without Liger's
  Triton activation (the two differ only on CUDA with liger-kernel installed).
- ``auto``: ours with ``num_shards="auto"`` (its own shard policy, whatever ``num_shards`` says).
- ``deepspeed``: DeepSpeed's TiledMLP (the algorithm ms-swift, Liger and Axolotl reuse), when installed.
- ``liger``: Liger's ``LigerTiledSwiGLUMLP`` (Triton SiLU-mul; CUDA only), when liger-kernel is installed.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from types import SimpleNamespace
from typing import Callable, Dict

import torch

from tiled_mlp.core import TiledMLP


def _untiled(mlp, num_shards):
    return mlp


def _ours(path: str, auto: bool = False, use_fused_kernel: bool = True):
    def make(mlp, num_shards):
        # Tiling is in place; the implementations share one MLP, so each tiles a shallow copy (the
        # same parameters and submodules, its own class and tiling).
        return TiledMLP(copy.copy(mlp), num_shards="auto" if auto else num_shards, path=path, use_fused_kernel=use_fused_kernel)

    return make


def _deepspeed(mlp, num_shards):
    # DeepSpeed logs its accelerator detection to stdout on import, which would corrupt `--json`.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DeepSpeedTiledMLP

    def mlp_forward(module, x):
        return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

    # DeepSpeed sets a per-shard `ds_grad_is_ready` flag on these; outside ZeRO-3 nothing reads it.
    compute_params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
    return lambda x: DeepSpeedTiledMLP.apply(mlp_forward, mlp, x, num_shards, compute_params)


def _liger(mlp, num_shards):
    # Read in liger-kernel's src/liger_kernel/transformers/tiled_mlp.py: LigerTiledSwiGLUMLP(config, num_shards)
    # reads config.hidden_size, intermediate_size and hidden_act, owns gate_proj/up_proj/down_proj Linears
    # and tiles with its own apply_tiled_mlp. Its Linears are swapped for the bench MLP's, so every
    # implementation steps the same weights.
    from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

    config = SimpleNamespace(hidden_size=mlp.gate_proj.in_features, intermediate_size=mlp.gate_proj.out_features,
                             hidden_act="silu")
    with torch.device("meta"):  # its own weights are replaced at once: allocate none
        liger = LigerTiledSwiGLUMLP(config, num_shards=num_shards)
    liger.gate_proj, liger.up_proj, liger.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    return liger


IMPLS: Dict[str, Callable] = {
    "untiled": _untiled,
    "deepspeed": _deepspeed,
    "generic": _ours("generic"),
    "fast": _ours("fast"),
    # On CUDA with liger-kernel installed "fast" uses Liger's Triton SiLU-mul; this is the native one.
    "fast_native_act": _ours("fast", use_fused_kernel=False),
    "auto": _ours("auto", auto=True),
    "liger": _liger,
}


def available_impls():
    names = list(IMPLS)
    if importlib.util.find_spec("deepspeed") is None:
        names.remove("deepspeed")
    if importlib.util.find_spec("liger_kernel") is None:
        names.remove("liger")
    return names
