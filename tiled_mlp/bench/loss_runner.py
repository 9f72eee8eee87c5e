"""Runs the three measurements of ``tiled-mlp bench-loss`` and returns one row per method.

1. gradient error against the untiled loss (small float32 case): first, as it is quick and shows a
   broken path before the long part;
2. peak memory at full size with fake tensors (bf16, the seed's 131072 x 4096 x 128256);
3. CPU time (float32, interleaved rounds), the long part.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .loss_accuracy import gradient_errors
from .loss_memory import fake_peak, memory_reference
from .loss_methods import available_methods, make_case, run_step, shard_count
from .loss_timing import medians, timed_rounds
from .measure import storage_bytes

Size = Tuple[int, int, int]  # tokens, hidden, vocab

# At float32 weights grad_accum_dtype=torch.float32 changes nothing (the accumulator is float32 either
# way): the same code runs, so timing it again would only add minutes of noise.
NOT_TIMED = {"ours_fp32": "as ours (fp32 weights)"}


@dataclass
class LossBenchConfig:
    memory_size: Size = (131072, 4096, 128256)
    memory_dtype: torch.dtype = torch.bfloat16
    time_size: Size = (8192, 1024, 32000)
    accuracy_size: Size = (4096, 64, 32000)
    rounds: int = 5
    # ArcticTraining's own policy (1 GiB of fp32 logits a shard) gives one shard at the small accuracy
    # size; a fixed count shows the error with real sharding (it does not depend on the count).
    deepspeed_accuracy_shards: int = 4
    seed: int = 0
    # Where the time (and, on CUDA, the allocator's peak) and the gradient error are measured, and the
    # timed size's dtype; the modelled peak is the fake tensors' wherever this runs.
    device: str = "cpu"
    time_dtype: torch.dtype = torch.float32

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["memory_dtype"] = str(self.memory_dtype).replace("torch.", "")
        out["time_dtype"] = str(self.time_dtype).replace("torch.", "")
        return out


def run_loss_bench(cfg: LossBenchConfig, on_step: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    step = on_step or (lambda label: None)
    methods, skipped = available_methods()
    rows: Dict[str, Dict[str, Any]] = {name: dict(method=name, label=m.label) for name, m in methods.items()}
    dtypes = {"memory": cfg.memory_dtype, "time": cfg.time_dtype, "accuracy": torch.float32}
    for name, row in rows.items():
        row["shards"] = {}
        for what, size in (("memory", cfg.memory_size), ("time", cfg.time_size), ("accuracy", cfg.accuracy_size)):
            fixed = cfg.deepspeed_accuracy_shards if what == "accuracy" else None
            row["shards"][what] = shard_count(name, *size, dtypes[what], fixed)

    errors = gradient_errors(methods, *cfg.accuracy_size, cfg.deepspeed_accuracy_shards, cfg.seed,
                             on_method=lambda name: step(f"gradient error: {name}"), device=cfg.device)
    for name, row in rows.items():
        row["errors"] = errors[name]

    for name, method in methods.items():
        peak = fake_peak(method, *cfg.memory_size, cfg.memory_dtype)
        rows[name].update(peak_bytes=peak.peak_bytes, peak_error=peak.error, answered=peak.answered,
                          largest_at_peak=[dict(what=w, bytes=b, count=n) for w, b, n in peak.largest])
        step(f"peak memory: {name}")

    # NOT_TIMED holds at float32 weights only: under bf16 the float32 accumulation is other code.
    not_timed = NOT_TIMED if cfg.time_dtype == torch.float32 else {}
    timed = {name: m for name, m in methods.items() if name not in not_timed}
    head, x, labels = make_case(*cfg.time_size, cfg.time_dtype, cfg.seed, cfg.device)
    steps = {name: m.make(head) for name, m in timed.items()}
    if x.device.type == "cuda":  # the allocator's peak of each step at the timed size, beside the model's
        for name, loss_step in steps.items():
            rows[name]["device_peak_bytes"] = cuda_step_peak(loss_step, head, x, labels)
            step(f"allocator peak: {name}")
    samples = timed_rounds(steps, head, x, labels, cfg.rounds, on_round=step)
    seconds = medians(samples)
    for name, row in rows.items():
        row["seconds"] = seconds.get(name)
        row["time_samples"] = samples.get(name)
        row["time_note"] = not_timed.get(name)
        row["time_ratio"] = None if name not in seconds else seconds[name] / seconds["untiled"]

    reference = memory_reference(*cfg.memory_size, cfg.memory_dtype)
    return dict(config=cfg.as_dict(), torch=torch.__version__, skipped=skipped, rows=list(rows.values()),
                reference=dict(floor_bytes=reference.floor_bytes, shard_tokens=reference.shard_tokens,
                               shard_pair_bytes=reference.shard_pair_bytes,
                               floor_plus_shard_bytes=reference.floor_plus_shard))


def cuda_step_peak(loss_step, head, x, labels) -> int:
    """The allocator's peak over one step, above what the process held before it, plus x, the labels and
    W (held before it: counted as the modelled peak counts them)."""
    head.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    held = torch.cuda.memory_allocated(x.device)
    run_step(loss_step, head, x, labels)
    torch.cuda.synchronize(x.device)
    return torch.cuda.max_memory_allocated(x.device) - held + storage_bytes(x, labels, head.weight)


def total_steps(rounds: int) -> int:
    """Progress steps of one run: gradient errors and peaks per method, the warm-up and timed rounds."""
    return 2 * len(available_methods()[0]) + rounds + 1
