"""Runs the benchmark grid (sequence lengths x implementations) and returns one row per cell."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from .impls import IMPLS
from .measure import make_inputs, max_relative_error, peak_bytes, shards_used, step_outputs, step_seconds
from .mlp import seeded_mlp
from .model_memory import modeled_step
from .progress import Progress

MiB = 2**20


@dataclass
class BenchConfig:
    hidden: int = 512
    intermediate: int = 1408
    seqs: List[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    num_shards: Union[int, str] = "auto"
    impls: List[str] = field(default_factory=lambda: ["untiled", "auto"])
    repeats: int = 3
    batch: int = 1
    model_memory: bool = False
    seed: int = 0
    tp: int = 1  # model one rank of tensor parallelism over this many ranks (model_memory only)


def shards_for(impl: str, cfg: BenchConfig, seq: int) -> Union[int, str]:
    if impl in ("deepspeed", "liger"):
        # DeepSpeed's own policy (Liger's too): about `hidden` tokens per shard.
        return max(1, math.ceil(seq * cfg.batch / cfg.hidden)) if cfg.num_shards == "auto" else cfg.num_shards
    if impl == "untiled":
        return 1
    return cfg.num_shards


def _measure_real(cfg: BenchConfig, seq: int, impls: List[str], progress: Progress) -> List[dict]:
    device = torch.device(cfg.device)
    mlp = seeded_mlp(cfg.hidden, cfg.intermediate, cfg.dtype, device, cfg.seed)
    x, grad_out = make_inputs(seq, cfg.hidden, cfg.dtype, device, cfg.batch, cfg.seed)
    reference = step_outputs(IMPLS["untiled"](mlp, 1), mlp, x, grad_out)
    rows: List[Dict[str, Any]] = []
    step_fns: Dict[str, Callable] = {}
    for impl in impls:
        shards = shards_for(impl, cfg, seq)
        step_fn = step_fns[impl] = IMPLS[impl](mlp, shards)
        error = max_relative_error(step_outputs(step_fn, mlp, x, grad_out), reference)
        peak = peak_bytes(step_fn, mlp, x, grad_out)
        rows.append(dict(seq=seq, impl=impl, num_shards=shards_used(step_fn, shards), peak_mb=peak / MiB, grad_rel_err=error))
        progress.step(f"seq {seq} {impl}: gradients and memory")
    # Timed together, interleaved, so that the ratios to untiled compare steps run side by side.
    seconds = step_seconds(step_fns, mlp, x, grad_out, repeats=cfg.repeats,
                           on_round=lambda r: progress.step(f"seq {seq}: timed round {r + 1}/{cfg.repeats}"))
    for row in rows:
        row["ms"] = seconds[row["impl"]] * 1e3
    return rows


def _measure_model(cfg: BenchConfig, seq: int, impls: List[str], progress: Progress) -> List[dict]:
    rows = []
    for impl in impls:
        shards = shards_for(impl, cfg, seq)
        peak, used = modeled_step(impl, cfg.hidden, cfg.intermediate, seq, cfg.dtype, shards, cfg.batch, cfg.device,
                                  cfg.tp)
        rows.append(dict(seq=seq, impl=impl, num_shards=used, ms=None, peak_mb=peak / MiB, grad_rel_err=None))
        progress.step(f"seq {seq} {impl}")
    return rows


def run_bench(cfg: BenchConfig, show_progress: bool = True, progress: Optional[Progress] = None) -> List[dict]:
    """``progress``: where each measurement is reported (default: a bar of its own)."""
    impls = ["untiled"] + [i for i in cfg.impls if i != "untiled"]
    rounds = 0 if cfg.model_memory else cfg.repeats
    progress = progress or Progress(len(cfg.seqs) * (len(impls) + rounds), "bench", enabled=show_progress)
    rows: List[dict] = []
    try:
        for seq in cfg.seqs:
            measure = _measure_model if cfg.model_memory else _measure_real
            cells = measure(cfg, seq, impls, progress)
            base = cells[0]
            for cell in cells:
                cell["mem_ratio"] = cell["peak_mb"] / base["peak_mb"]
                cell["time_ratio"] = None if cell["ms"] is None else cell["ms"] / base["ms"]
            rows.extend(cells)
    finally:
        progress.close()
    return rows
