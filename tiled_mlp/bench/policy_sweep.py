"""Evidence for the auto policy: the shard size (rule 1) and the pass-through floor (rule 3).

    python -m tiled_mlp.bench.policy_sweep [--table shard-size|pass-through|both]

Shard size. Memory: fake-tensor model at the seed's size (hidden 4096, intermediate 12288, bf16,
131072 and 32768 tokens). Time: CPU fp32, hidden 1024, intermediate 2816, 16384 tokens, as a ratio to
untiled, every shard size timed interleaved with the untiled step.

Pass-through. At the sizes where tiling saves little (CPU fp32, 1024 to 4096 tokens), what the shards
rule 1 picks would save (the policy's estimate and the fake-tensor model) and what they cost in time
(the fast path against untiled, interleaved round by round: the median ratio and its interquartile
range), beside what "auto" decides.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

from tiled_mlp.core.auto_shards import auto_decision, estimated_saved_bytes, shard_count

from ..cli.plan_cmd import swiglu_size
from .cpu_allocator import keep_freed_memory_in_process
from .impls import IMPLS
from .measure import make_inputs, one_step, step_seconds
from .mlp import SwiGLUMLP
from .model_memory import modeled_peak_bytes
from .progress import Progress

TARGETS_MIB = (16, 32, 64, 128, 256, 512, 1024)
# (hidden, intermediate, tokens), CPU fp32: the default bench's size and the 1024/2816 one, where the
# estimated saving is under, near and over the floor.
PASS_THROUGH_CASES = ((512, 1408, 1024), (512, 1408, 2048), (512, 1408, 4096), (1024, 2816, 1024), (1024, 2816, 2048))
PASS_THROUGH_REPEATS = 15
MiB = 2**20


def shards_for_target(tokens: int, intermediate: int, element_bytes: int, target_mib: int) -> int:
    tokens_per_shard = max(1, target_mib * 2**20 // (intermediate * element_bytes))
    return max(1, math.ceil(tokens / tokens_per_shard))


def shard_size_table() -> None:
    repeats = 5
    progress = Progress(len(TARGETS_MIB) * 2 + repeats, "sweep")
    memory = {}
    for seq in (32768, 131072):
        untiled = modeled_peak_bytes("untiled", 4096, 12288, seq, torch.bfloat16, 1)
        for target in TARGETS_MIB:
            n = shards_for_target(seq, 12288, 2, target)
            memory[(seq, target)] = (n, modeled_peak_bytes("fast", 4096, 12288, seq, torch.bfloat16, n) / untiled)
            progress.step(f"memory seq {seq} {target} MiB")
    seq, hidden, inter = 16384, 1024, 2816
    torch.manual_seed(0)
    mlp = SwiGLUMLP(hidden, inter)
    x, dy = make_inputs(seq, hidden, torch.float32, "cpu")
    counts = {target: shards_for_target(seq, inter, 4, target) for target in TARGETS_MIB}
    step_fns: Dict[Any, Callable] = {"untiled": mlp, **{target: IMPLS["fast"](mlp, n) for target, n in counts.items()}}
    seconds = step_seconds(step_fns, mlp, x, dy, repeats=repeats,
                           on_round=lambda r: progress.step(f"timed round {r + 1}/{repeats}"))
    times = {target: (n, seconds[target] / seconds["untiled"]) for target, n in counts.items()}
    progress.close()
    print("| MiB per shard buffer | shards @131072 | peak vs untiled @131072 | shards @32768 | peak vs untiled @32768 "
          "| CPU shards @16384 | CPU time vs untiled |")
    print("|---|---|---|---|---|---|---|")
    for target in TARGETS_MIB:
        (n1, r1), (n2, r2), (n3, t3) = memory[(131072, target)], memory[(32768, target)], times[target]
        print(f"| {target} | {n1} | {r1:.3f} | {n2} | {r2:.3f} | {n3} | {t3:.3f} |")


def _time_ratios(mlp, tiled, x, dy, repeats: int, warmup: int = 3) -> List[float]:
    """Per-round tiled/untiled ratios, the two steps interleaved so a slow spell hits both."""
    for step_fn in (mlp, tiled):
        for _ in range(warmup):
            one_step(step_fn, mlp, x, dy)
    ratios = []
    for _ in range(repeats):
        seconds = []
        for step_fn in (mlp, tiled):
            start = time.perf_counter()
            one_step(step_fn, mlp, x, dy)
            seconds.append(time.perf_counter() - start)
        ratios.append(seconds[1] / seconds[0])
    return ratios


def pass_through_table() -> None:
    keep_freed_memory_in_process()
    progress = Progress(len(PASS_THROUGH_CASES), "pass-through")
    rows = []
    for hidden, inter, tokens in PASS_THROUGH_CASES:
        size = swiglu_size(hidden, inter, torch.float32)
        n = shard_count(tokens, size)
        untiled = modeled_peak_bytes("untiled", hidden, inter, tokens, torch.float32, 1)
        modelled = untiled - modeled_peak_bytes("fast", hidden, inter, tokens, torch.float32, n)
        torch.manual_seed(0)
        mlp = SwiGLUMLP(hidden, inter)
        x, dy = make_inputs(tokens, hidden, torch.float32, "cpu")
        ratios = _time_ratios(mlp, IMPLS["fast"](mlp, n), x, dy, PASS_THROUGH_REPEATS)
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        decision = auto_decision(tokens, size)
        rows.append(f"| {hidden} | {inter} | {tokens} | {n} | {estimated_saved_bytes(tokens, size, n) / MiB:.1f} "
                    f"| {modelled / MiB:.1f} | {untiled / MiB:.1f} | {median:.3f} ({q1:.3f}-{q3:.3f}) "
                    f"| {'untiled' if decision.num_shards is None else f'{decision.num_shards} shards'} |")
        progress.step(f"{hidden}/{inter} @{tokens}")
    progress.close()
    print(f"| hidden | intermediate | tokens | shards (rule 1) | estimated saving MiB | modelled saving MiB "
          f"| untiled peak MiB | CPU time vs untiled, median (IQR) of {PASS_THROUGH_REPEATS} | auto |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tiled_mlp.bench.policy_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=("shard-size", "pass-through", "both"), default="both")
    args = parser.parse_args(argv)
    if args.table in ("shard-size", "both"):
        shard_size_table()
    if args.table in ("pass-through", "both"):
        pass_through_table()


if __name__ == "__main__":
    main()
