"""The sections ``tiled-mlp gpu-report`` measures, each composed of the existing benchmarks at GPU sizes.

A section is ``measure(ctx) -> {row key: row}``: every row it measured, as JSON-ready dicts (``gpu_doc``
renders them and keeps the rows a run did not measure). Each section stops starting new rows once its time
budget is spent; the rows it skipped keep their previous figures.

Estimated GPU seconds per section, from docs/gpu.md's H200 step times (warm-up and interleaved rounds at
``--repeats 10``; compile and attention times are the larger parts where they appear):
- mlp: 4 lengths x 4 implementations x ~15 steps; at 131072 tokens the four steps take ~0.95 s: ~40 s;
- checkpointed: 2 regions x 3 implementations x ~15 steps at 32768 tokens (the decoder layer 184 ms): ~30 s;
- loss: one bench-loss run, its time at 16384 x 4096 x 128256 bf16 (about 0.1 s a step), its modelled peaks
  at 131072 tokens (fake tensors, host time): ~60 s;
- compiled: two sizes, each compiling two variants' forward and backward with inductor: ~120 s;
- planner: 5 real steps of 4 layers (two each: warm-up and measured), the longest at 262144 tokens
  (~25 s a step by attention's quadratic time from 131072's): ~120 s.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch

from tiled_mlp.core import auto_shards

from .progress import Progress

MLP_HIDDEN, MLP_INTERMEDIATE = 4096, 12288  # the seed's
MLP_SEQS = (2048, 8192, 32768, 131072)
CHECKPOINTED = dict(hidden=4096, intermediate=12288, seq=32768, heads=32)
LOSS_MEMORY_SIZE, LOSS_TIME_SIZE, LOSS_ACCURACY_SIZE = (131072, 4096, 128256), (16384, 4096, 128256), (4096, 64, 32000)
COMPILE_SIZES = ((8192, 1024, 2816), (32768, 4096, 12288))
PLANNER_SEQS = (16384, 65536, 131072)
PLANNER_DEPTH = 4
PLANNER_UNTILED_MAX = 16384  # untiled, 65536 tokens at 4 layers take 101.6 GiB (docs/gpu.md): more than an H100


@dataclass
class Context:
    device: torch.device
    repeats: int
    budget_s: float  # this section's: no new row starts once it is spent
    say: Callable[[str], None]  # one line per measurement
    planner_max_seq: int = 262144
    deadline: float = math.inf  # the whole report's (time.perf_counter()): no new row starts after it
    started: float = field(default_factory=time.perf_counter)

    def allows(self) -> bool:
        now = time.perf_counter()
        return now - self.started < self.budget_s and now < self.deadline


class LineProgress(Progress):
    """The benches' ``Progress`` as one line per step, through ``say`` (no bar: lines stay readable in a log)."""

    def __init__(self, say: Callable[[str], None], what: str):  # no super().__init__: it would open a bar
        self._say, self._what = say, what

    def step(self, label: str) -> None:
        self._say(f"{self._what}: {label}")

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _quiet_stdout():
    # DeepSpeed and compilers may print on stdout: the report's lines go to stderr, the table to the doc.
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mlp_impls() -> List[str]:
    """untiled and ours, and each peer that imports here (liger-kernel's tiled MLP came in a later release
    than its first: an installed one without it is left out)."""
    from .impls import available_impls

    names = [i for i in ("untiled", "auto", "deepspeed", "liger") if i in available_impls()]
    if "liger" in names:
        try:
            from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP  # noqa: F401
        except Exception:  # not in this release, or its Triton kernels cannot load here
            names.remove("liger")
    return names


def measure_mlp(ctx: Context) -> Dict[str, dict]:
    from .runner import BenchConfig, run_bench

    rows = {}
    for seq in MLP_SEQS:
        if not ctx.allows():
            ctx.say(f"mlp: {seq} tokens skipped (section budget {ctx.budget_s:.0f} s or the report's spent)")
            continue
        cfg = BenchConfig(seqs=[seq], dtype=torch.bfloat16, device=str(ctx.device), impls=mlp_impls(),
                          repeats=ctx.repeats, hidden=MLP_HIDDEN, intermediate=MLP_INTERMEDIATE)
        with _quiet_stdout():
            cells = run_bench(cfg, progress=LineProgress(ctx.say, f"mlp {seq}"))
        rows[str(seq)] = dict(seq=seq, hidden=MLP_HIDDEN, intermediate=MLP_INTERMEDIATE,
                              cells={c["impl"]: c for c in cells})
    return rows


def measure_checkpointed(ctx: Context) -> Dict[str, dict]:
    from .checkpointed import REGIONS, run

    impls = ["untiled", "ours"] + (["deepspeed"] if _have("deepspeed") else [])
    regions = [r for r in REGIONS if r != "llama-layer" or _have("transformers")]
    rows = {}
    for region in regions:
        if not ctx.allows():
            ctx.say(f"checkpointed: {region} skipped (section budget {ctx.budget_s:.0f} s or the report's spent)")
            continue
        with _quiet_stdout():
            cells = run(region, impls, CHECKPOINTED["hidden"], CHECKPOINTED["intermediate"], CHECKPOINTED["seq"],
                        torch.bfloat16, ctx.repeats, CHECKPOINTED["heads"], "auto",
                        LineProgress(ctx.say, "checkpointed").step, ctx.device)
        rows[region] = dict(region=region, **CHECKPOINTED, cells={c["impl"]: c for c in cells})
    return rows


def measure_loss(ctx: Context) -> Dict[str, dict]:
    from .loss_runner import LossBenchConfig, run_loss_bench

    cfg = LossBenchConfig(memory_size=LOSS_MEMORY_SIZE, time_size=LOSS_TIME_SIZE, accuracy_size=LOSS_ACCURACY_SIZE,
                          rounds=ctx.repeats, device=str(ctx.device), time_dtype=torch.bfloat16)
    with _quiet_stdout():
        result = run_loss_bench(cfg, on_step=LineProgress(ctx.say, "loss").step)
    config = result["config"]
    return {row["method"]: dict(row, config=config, skipped=result["skipped"]) for row in result["rows"]}


def measure_compiled(ctx: Context) -> Dict[str, dict]:
    from .compiled import CompileBenchConfig, run_compile_bench

    rows = {}
    for seq, hidden, intermediate in COMPILE_SIZES:
        key = f"{seq}x{hidden}x{intermediate}"
        if not ctx.allows():
            ctx.say(f"compiled: {key} skipped (section budget {ctx.budget_s:.0f} s or the report's spent)")
            continue
        cfg = CompileBenchConfig(hidden=hidden, intermediate=intermediate, seq=seq, dtype=torch.bfloat16,
                                 device=str(ctx.device), repeats=ctx.repeats, warmup=3)
        with _quiet_stdout():
            result = run_compile_bench(cfg, progress=LineProgress(ctx.say, f"compiled {key}"))
        rows[key] = dict(seq=seq, hidden=hidden, intermediate=intermediate, **result)
    return rows


def measure_planner(ctx: Context) -> Dict[str, dict]:
    from . import planner_vs_device

    total = torch.cuda.get_device_properties(ctx.device).total_memory
    longest = planner_vs_device.longest_fitting(total, PLANNER_DEPTH, ctx.planner_max_seq,
                                                shards_as=auto_shards.device_class(ctx.device))
    ctx.say(f"planner: longest whole-stack length modelled to fit 0.9 of {total / 2**30:.1f} GiB at "
            f"{PLANNER_DEPTH} layers (capped at {ctx.planner_max_seq}): {longest}")

    def said(row: dict) -> None:
        ctx.say(f"planner: {row['seq']} {row['setting']}: modelled {row['modelled_gib']:.3f} GiB + attention "
                f"workspace {row['workspace_gib']:.3f} GiB, allocator {row['allocator_gib']:.3f} GiB "
                f"({row['allocator_over_modelled']:.3f} of both)")

    rows = planner_vs_device.run(PLANNER_SEQS, PLANNER_DEPTH, ctx.device, PLANNER_UNTILED_MAX, longest, said,
                                 ctx.allows)
    return {f"{r['seq']} {r['setting']}": dict(r, device_gib=total / 2**30, cap=ctx.planner_max_seq) for r in rows}


@dataclass(frozen=True)
class Section:
    title: str
    measure: Callable[[Context], Dict[str, dict]]
    estimate_s: int  # GPU seconds, from docs/gpu.md's timings (the module's docstring)
    budget_s: int


SECTIONS: Dict[str, Section] = {
    "mlp": Section("The MLP at the seed's size", measure_mlp, 40, 90),
    "checkpointed": Section("Checkpointed MLP half and decoder layer", measure_checkpointed, 30, 75),
    "loss": Section("The tiled loss against torch's chunked loss", measure_loss, 60, 90),
    "compiled": Section("The compiled step", measure_compiled, 120, 150),
    "planner": Section("The planner against a real step", measure_planner, 120, 150),
}
