"""``tiled-mlp bench --compile``: does ``torch.compile`` keep a tiled MLP's speed and memory?

Four step variants of one SwiGLU MLP, sharing its weights: eager untiled, eager tiled, compiled untiled,
compiled tiled. A step is forward and backward of ``sum(out * grad_out)`` (``out.backward(grad_out)``, the
same gradient without the product's buffer) on a fresh leaf input, as ``measure.one_step`` does.

- time: the median step, rounds interleaved (round r runs every variant once, starting at a different
  one each round), after warm-up steps that include the compile, so a slow spell of the machine and the
  order within a round fall on all four alike;
- memory: every allocation the allocator reports to the profiler (``profile_memory``), which sees the
  buffers inside inductor's generated code as well as eager ops (a dispatch-mode tracker sees only the
  latter), plus the input, grad_output and weights live before the step; the same measure for all four;
- gradients: output, input grad and weight grads of each variant against eager untiled;
- ``torch._dynamo.explain`` of the compiled tiled module: its graph and break counts show whether the
  tiled call traced into the graph or ran as a break.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from tiled_mlp.core import TiledMLP

from .cpu_allocator import keep_freed_memory_in_process
from .measure import make_inputs, max_relative_error, shards_used, storage_bytes
from .mlp import seeded_mlp
from .progress import Progress

MiB = 2**20
VARIANTS = ("eager_untiled", "eager_tiled", "compiled_untiled", "compiled_tiled")
# The compiled step's targets (compiled tiled within 1.20 of compiled untiled, no slower than eager tiled); a miss is reported as such, never by loosening these.
TARGETS = {"compiled_tiled/compiled_untiled": 1.20, "compiled_tiled/eager_tiled": 1.00}


@dataclass
class CompileBenchConfig:
    hidden: int = 1024
    intermediate: int = 2816
    seq: int = 8192
    batch: int = 1
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    num_shards: Union[int, str] = "auto"
    backend: str = "inductor"
    repeats: int = 5
    warmup: int = 2  # the first step of a compiled variant compiles its forward and backward
    seed: int = 0


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def variant_step(module: Callable, mlp: nn.Module, x_data: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """One step on a fresh leaf input (sharing ``x_data``'s storage: no copy); returns that input."""
    mlp.zero_grad(set_to_none=True)
    x = x_data.detach().requires_grad_(True)
    module(x).backward(grad_out)
    return x


def variant_outputs(module: Callable, mlp: nn.Module, x_data, grad_out) -> List[torch.Tensor]:
    mlp.zero_grad(set_to_none=True)
    x = x_data.detach().requires_grad_(True)
    y = module(x)
    y.backward(grad_out)
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    assert all(g is not None for g in grads), "every input and weight of the benchmarked MLP gets a gradient"
    return [y.detach()] + [g.clone() for g in grads if g is not None]


def allocated_peak_bytes(module: Callable, mlp: nn.Module, x_data, grad_out) -> int:
    """Peak bytes held during one step: those live before it (input, grad_output, weights) plus the
    highest running sum of the allocations and frees the allocator reports to the profiler in it."""
    mlp.zero_grad(set_to_none=True)
    device = x_data.device
    before = storage_bytes(x_data, grad_out, *mlp.parameters())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _synchronize(device)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        variant_step(module, mlp, x_data, grad_out)
        _synchronize(device)
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name.lower() == device.type]
    running = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return before + peak


def interleaved_seconds(modules: Dict[str, Callable], mlp, x_data, grad_out, repeats: int,
                        on_round: Callable[[int], None]) -> Dict[str, List[float]]:
    """Seconds of each timed step per variant; round r starts at variant r mod 4 and runs each once."""
    names = list(modules)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _synchronize(x_data.device)
            start = time.perf_counter()
            variant_step(modules[name], mlp, x_data, grad_out)
            _synchronize(x_data.device)
            times[name].append(time.perf_counter() - start)
        on_round(r)
    return times


def _explain(module: nn.Module, x_data) -> Dict[str, object]:
    # explain resets dynamo's caches: run before anything is compiled.
    out = torch._dynamo.explain(module)(x_data.detach().requires_grad_(True))
    return dict(graph_count=out.graph_count, graph_break_count=out.graph_break_count,
                break_reasons=sorted({str(getattr(b, "reason", b)).splitlines()[0] for b in out.break_reasons}))


def build_variants(cfg: CompileBenchConfig) -> Tuple[nn.Module, Dict[str, nn.Module]]:
    device = torch.device(cfg.device)
    mlp = seeded_mlp(cfg.hidden, cfg.intermediate, cfg.dtype, device, cfg.seed)
    # Tiling is in place: each tiled variant tiles its own shallow copy (same weights), as impls.py does.
    tiled = {name: TiledMLP(copy.copy(mlp), num_shards=cfg.num_shards, path="auto")
             for name in ("eager_tiled", "compiled_tiled")}
    return mlp, dict(eager_untiled=mlp, eager_tiled=tiled["eager_tiled"], compiled_untiled=mlp,
                     compiled_tiled=tiled["compiled_tiled"])


def run_compile_bench(cfg: CompileBenchConfig, show_progress: bool = True, progress: Optional[Progress] = None) -> dict:
    """``progress``: where each step is reported (default: a bar of its own)."""
    device = torch.device(cfg.device)
    if device.type == "cpu":
        keep_freed_memory_in_process()  # steady CPU timings (see cpu_allocator)
    torch._dynamo.reset()
    mlp, built = build_variants(cfg)
    modules: Dict[str, Callable] = dict(built)
    x_data, grad_out = make_inputs(cfg.seq, cfg.hidden, cfg.dtype, device, cfg.batch, cfg.seed)
    x_data.requires_grad_(False)
    steps = 1 + len(VARIANTS) * (cfg.warmup + 1) + cfg.repeats
    progress = progress or Progress(steps, f"bench --compile ({cfg.backend})", enabled=show_progress)
    try:
        explain = _explain(built["compiled_tiled"], x_data)
        progress.step("dynamo explain of the compiled tiled module")
        # The same modules, compiled: the eager variants keep calling them uncompiled.
        for name in ("compiled_untiled", "compiled_tiled"):
            modules[name] = torch.compile(modules[name], backend=cfg.backend)
        for name in VARIANTS:
            for i in range(cfg.warmup):
                what = "compiling + warm-up" if name.startswith("compiled") and i == 0 else "warm-up"
                variant_step(modules[name], mlp, x_data, grad_out)
                progress.step(f"{name}: {what} {i + 1}/{cfg.warmup}")
        reference = variant_outputs(modules["eager_untiled"], mlp, x_data, grad_out)
        rows: Dict[str, dict] = {}
        for name in VARIANTS:
            error = max_relative_error(variant_outputs(modules[name], mlp, x_data, grad_out), reference)
            peak = allocated_peak_bytes(modules[name], mlp, x_data, grad_out)
            rows[name] = dict(peak_mb=peak / MiB, grad_rel_err=error)
            progress.step(f"{name}: gradients and memory")
        seconds = interleaved_seconds({n: modules[n] for n in VARIANTS}, mlp, x_data, grad_out, cfg.repeats,
                                      lambda r: progress.step(f"timed round {r + 1}/{cfg.repeats}"))
    finally:
        progress.close()
    for name, row in rows.items():
        # The median, and every round (two cores drift by tens of percent: the spread says how much here).
        row["ms"] = statistics.median(seconds[name]) * 1e3
        row["rounds_ms"] = [t * 1e3 for t in seconds[name]]
    shards = shards_used(built["eager_tiled"], 1)  # what its last call ran
    return dict(variants=rows, explain=explain, **verdicts(cfg, rows, shards))


def verdicts(cfg: CompileBenchConfig, rows: Dict[str, dict], shards: int) -> dict:
    ratios = {"compiled_tiled/compiled_untiled": rows["compiled_tiled"]["ms"] / rows["compiled_untiled"]["ms"],
              "compiled_tiled/eager_tiled": rows["compiled_tiled"]["ms"] / rows["eager_tiled"]["ms"]}
    time_checks = {k: dict(ratio=v, target=TARGETS[k], verdict="PASS" if v <= TARGETS[k] else "MISS")
                   for k, v in ratios.items()}
    # One shard's buffers: gate, up, their activation product and its gradient, each shard_tokens x intermediate.
    shard_tokens = math.ceil(cfg.seq * cfg.batch / shards)
    one_shard = 4 * shard_tokens * cfg.intermediate * torch.empty((), dtype=cfg.dtype).element_size()
    extra = (rows["compiled_tiled"]["peak_mb"] - rows["eager_tiled"]["peak_mb"]) * MiB
    memory = dict(compiled_tiled_minus_eager_tiled_mb=extra / MiB, num_shards=shards, shard_tokens=shard_tokens,
                  one_shard_buffers_mb=one_shard / MiB, within_one_shard=extra <= one_shard)
    return dict(time=time_checks, memory=memory)


def format_compile_report(result: dict, config: dict) -> str:
    lines = [f"SwiGLU MLP hidden={config['hidden']} intermediate={config['intermediate']} {config['dtype']} "
             f"tokens={config['seq'] * config['batch']} on {config['device']}, fwd+bwd, torch.compile backend "
             f"{config['backend']!r}; median of {config['repeats']} interleaved rounds; memory: allocator peak "
             "(input, grad_output, weights and grads included)",
             "| variant | ms | peak MB | grad err vs eager untiled |", "|---|---|---|---|"]
    for name, row in result["variants"].items():
        lines.append(f"| {name} | {row['ms']:.1f} | {row['peak_mb']:.1f} | {row['grad_rel_err']:.1e} |")
    for key, check in result["time"].items():
        lines.append(f"{key}: {check['ratio']:.3f} (target <= {check['target']:.2f}) {check['verdict']}")
    mem = result["memory"]
    lines.append(f"compiled tiled - eager tiled peak: {mem['compiled_tiled_minus_eager_tiled_mb']:+.1f} MB; one shard's "
                 f"buffers ({mem['num_shards']} shards of {mem['shard_tokens']} tokens): {mem['one_shard_buffers_mb']:.1f} MB"
                 f" -> {'within' if mem['within_one_shard'] else 'MORE than'} one shard")
    ex = result["explain"]
    if ex["graph_count"] == 0:  # explain then reports -1 breaks
        lines.append("dynamo explain (compiled tiled): no graph captured: the tiled call ran outside dynamo "
                     "(a torch.compiler.disable frame), eagerly")
    else:
        lines.append(f"dynamo explain (compiled tiled): {ex['graph_count']} graph(s), {ex['graph_break_count']} "
                     "break(s)" + (f": {'; '.join(ex['break_reasons'])}" if ex["break_reasons"] else ""))
    return "\n".join(lines)
