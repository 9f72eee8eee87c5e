"""The planner's modelled step (meta tensors) against the same step run on a device: the live-storage
tracker's peak on the device (exact bytes) and the caching allocator's ``max_memory_allocated``, for
Llama-3.1-8B's shapes cut to a few layers, untiled and with the whole stack (docs/gpu.md's planner table).

The allocator sees what the trackers cannot: memory a kernel allocates for itself (attention's backward
workspace). A GPU plan models it (``tiled_mlp/planner/attention_workspace.py``); each row reports it beside
the peak without it, and the allocator against their sum.
"""
from __future__ import annotations

import gc
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch

from tiled_mlp.core import auto_shards
from tiled_mlp.core.auto_shards import DeviceClass

MODEL = "llama-3.1-8b"
GiB = 2**30
# The whole stack, and the untiled step it is held against.
SETTINGS = {
    "untiled+ckpt": dict(tiled=False, checkpointing=True),
    "tiled+tiled-loss+norms+ckpt": dict(tiled=True, checkpointing=True, tiled_loss=True, tiled_norms=True),
}
SEQ_STEP = 16384


def _setting(name: str):
    from tiled_mlp.planner.step import Setting

    return Setting(**SETTINGS[name])


def modelled_peak(seq: int, depth: int, setting_name: str, gpu: bool = True,
                  shards_as: Optional[DeviceClass] = None) -> int:
    """The planner's peak bytes of one step at ``seq`` tokens (meta tensors: nothing allocated), its tiled calls
    cut as the auto policy cuts them on ``shards_as`` (None: a Hopper-class GPU, as a GPU plan models it);
    ``gpu``: with the workspace sdpa's CUDA kernels allocate inside themselves."""
    from tiled_mlp.planner import attention
    from tiled_mlp.planner.attention_workspace import gpu_kernel
    from tiled_mlp.planner.plan import GPU_SHARD_DEVICE
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import build_model, step_timeline

    meta = build_model(load_config(MODEL), depth, torch.bfloat16, "meta", _setting(setting_name))
    try:
        with attention.gpu_workspace(gpu_kernel("sdpa") if gpu else None), \
                auto_shards.modelled_as(shards_as or GPU_SHARD_DEVICE):
            return int(step_timeline(meta, seq, 1).peak()[0])
    finally:
        del meta
        gc.collect()


def longest_fitting(device_bytes: int, depth: int, cap: int, fraction: float = 0.9,
                    shards_as: Optional[DeviceClass] = None) -> int:
    """The longest multiple of ``SEQ_STEP`` tokens (at most ``cap``) whose whole-stack step, modelled as on a
    GPU (the attention kernels' workspace included, shards as on ``shards_as``), fits ``fraction`` of
    ``device_bytes``; 0 if none."""
    from tiled_mlp.planner.search import longest_fitting as search

    name = "tiled+tiled-loss+norms+ckpt"

    def held(seq: int) -> float:
        return float(modelled_peak(seq, depth, name, shards_as=shards_as))

    return search(held, fraction * device_bytes, SEQ_STEP, cap).seq


def measure_row(seq: int, depth: int, setting_name: str, device: torch.device) -> Dict:
    """One row: the modelled peak, the tracked and allocator peaks of the same step on ``device``."""
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import build_model, step_timeline

    started = time.perf_counter()
    # Modelled as ``device`` cuts the shards of the step measured on it.
    shards_as = auto_shards.device_class(device)
    modelled = modelled_peak(seq, depth, setting_name, gpu=False, shards_as=shards_as)
    workspace = modelled_peak(seq, depth, setting_name, shards_as=shards_as) - modelled
    modelled_s = time.perf_counter() - started
    gc.collect()
    torch.cuda.empty_cache()
    model = build_model(load_config(MODEL), depth, torch.bfloat16, device, _setting(setting_name))
    try:
        step_timeline(model, seq, 1)  # warm-up: cuBLAS workspaces, kernels
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        tracked = int(step_timeline(model, seq, 1).peak()[0])
        torch.cuda.synchronize(device)
        allocator = torch.cuda.max_memory_allocated(device)
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    with_workspace = modelled + workspace
    return dict(seq=seq, setting=setting_name, depth=depth, modelled_gib=modelled / GiB,
                workspace_gib=workspace / GiB,
                tracked_gib=tracked / GiB, tracked_minus_modelled_bytes=tracked - modelled,
                allocator_gib=allocator / GiB, allocated_before_step_gib=before / GiB,
                allocator_over_modelled=allocator / with_workspace,
                modelled_s=modelled_s, device_s=time.perf_counter() - started - modelled_s)


def plan_rows(seqs: Iterable[int], longest: int, untiled_max: int) -> List[tuple]:
    """(seq, setting) pairs to measure: untiled up to ``untiled_max``, the whole stack at every length and
    at ``longest`` (when it is not among them)."""
    lengths = sorted(set(seqs) | ({longest} if longest else set()))
    return [(seq, name) for seq in lengths for name in SETTINGS
            if not (name.startswith("untiled") and seq > untiled_max)]


def run(seqs: Iterable[int], depth: int, device: torch.device, untiled_max: int, longest: int = 0,
        on_row: Optional[Callable[[Dict], None]] = None, allows: Callable[[], bool] = lambda: True) -> List[Dict]:
    """Every row of ``plan_rows``, shortest first; ``allows()`` False stops before the next row (a time budget)."""
    rows = []
    for seq, name in plan_rows(seqs, longest, untiled_max):
        if not allows():
            break
        row = measure_row(seq, depth, name, device)
        row["longest"] = seq == longest
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
