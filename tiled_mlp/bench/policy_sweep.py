"""Evidence for the auto policy's shard size: peak memory and time against bytes per shard.

    python -m tiled_mlp.bench.policy_sweep

Memory: fake-tensor model at the seed's size (hidden 4096, intermediate 12288, bf16, 131072 and
32768 tokens). Time: CPU fp32, hidden 1024, intermediate 2816, 16384 tokens, as a ratio to untiled,
every shard size timed interleaved with the untiled step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch

from .impls import IMPLS
from .measure import make_inputs, step_seconds
from .mlp import SwiGLUMLP
from .model_memory import modeled_peak_bytes
from .progress import Progress

TARGETS_MIB = (16, 32, 64, 128, 256, 512, 1024)


def shards_for_target(tokens: int, intermediate: int, element_bytes: int, target_mib: int) -> int:
    tokens_per_shard = max(1, target_mib * 2**20 // (intermediate * element_bytes))
    return max(1, math.ceil(tokens / tokens_per_shard))


def main() -> None:
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


if __name__ == "__main__":
    main()
