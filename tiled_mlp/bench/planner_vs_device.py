"""The planner's modelled step (meta tensors) against the same step run on a device: the live-storage
tracker's peak on the device (exact bytes) and the caching allocator's ``max_memory_allocated``, for
Llama-3.1-8B's shapes cut to a few layers, untiled and with the whole stack (docs/gpu.md's planner table).

The allocator sees what the trackers cannot: memory a kernel allocates for itself (attention's backward
workspace). ``modelled_kernel_workspace`` is where the planner's term for it is reported beside the
modelled peak once the planner has one.
"""
from __future__ import annotations

import gc
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch

MODEL = "llama-3.1-8b"
GiB = 2**30
# The whole stack, and the untiled step it is held against.
SETTINGS = {
    "untiled+ckpt": dict(tiled=False, checkpointing=True),
    "tiled+tiled-loss+norms+ckpt": dict(tiled=True, checkpointing=True, tiled_loss=True, tiled_norms=True),
}
# What the allocator held beyond the modelled peak per token on the H200 (docs/gpu.md: 1.38 GiB at 65536
# tokens, 3.14 GiB at 131072): the margin the longest-length search leaves for it while the planner does
# not model it.
UNMODELLED_BYTES_PER_TOKEN = 24 * 2**10
SEQ_STEP = 16384


def _setting(name: str):
    from tiled_mlp.planner.step import Setting

    return Setting(**SETTINGS[name])


def modelled_peak(seq: int, depth: int, setting_name: str) -> int:
    """The planner's peak bytes of one step at ``seq`` tokens (meta tensors: nothing allocated)."""
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import build_model, step_timeline

    meta = build_model(load_config(MODEL), depth, torch.bfloat16, "meta", _setting(setting_name))
    try:
        return int(step_timeline(meta, seq, 1).peak()[0])
    finally:
        del meta
        gc.collect()


def modelled_kernel_workspace(seq: int, depth: int, setting_name: str) -> Optional[int]:
    """The planner's bytes for memory kernels allocate for themselves at the step's peak (the attention
    backward's workspace), or None while the planner has no such term.

    Hook for the attention-workspace model (tiled_mlp/planner/attention.py): return its bytes for this
    step here; every row then reports modelled + workspace and the allocator over that sum."""
    return None


def longest_fitting(device_bytes: int, depth: int, cap: int, fraction: float = 0.9) -> int:
    """The longest multiple of ``SEQ_STEP`` tokens (at most ``cap``) whose whole-stack step, modelled, plus
    the unmodelled kernel memory measured per token, fits ``fraction`` of ``device_bytes``; 0 if none."""
    from tiled_mlp.planner.search import longest_fitting as search

    name = "tiled+tiled-loss+norms+ckpt"

    def held(seq: int) -> float:
        return float(modelled_peak(seq, depth, name) + UNMODELLED_BYTES_PER_TOKEN * seq)

    return search(held, fraction * device_bytes, SEQ_STEP, cap).seq


def measure_row(seq: int, depth: int, setting_name: str, device: torch.device) -> Dict:
    """One row: the modelled peak, the tracked and allocator peaks of the same step on ``device``."""
    from tiled_mlp.planner.presets import load_config
    from tiled_mlp.planner.step import build_model, step_timeline

    started = time.perf_counter()
    modelled = modelled_peak(seq, depth, setting_name)
    workspace = modelled_kernel_workspace(seq, depth, setting_name)
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
    with_workspace = modelled + (workspace or 0)
    return dict(seq=seq, setting=setting_name, depth=depth, modelled_gib=modelled / GiB,
                workspace_gib=None if workspace is None else workspace / GiB,
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
