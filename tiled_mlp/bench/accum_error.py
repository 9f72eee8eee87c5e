"""bf16 gradient error of the fast path against a float64 reference, by accumulator dtype and shard count.

    python -m tiled_mlp.bench.accum_error [--hidden 256 --intermediate 704 --seq 4096]

Each weight gradient is a sum over shards; accumulating it in bf16 rounds once per shard, so the
error grows with the shard count, while ``grad_accum_dtype=torch.float32`` rounds once at the end.
The untiled bf16 module is shown as the baseline every bf16 run is held to.
"""
from __future__ import annotations

import argparse
import math

import torch

from tiled_mlp.core import TiledMLP

from .measure import make_inputs, max_relative_error, step_outputs
from .mlp import SwiGLUMLP


def _weight_grad_error(step_fn, mlp, x, grad_out, reference) -> float:
    # Index 2 onwards: the weight gradients (0 is the output, 1 the input gradient).
    return max_relative_error(step_outputs(step_fn, mlp, x, grad_out)[2:], reference[2:])


def measure(hidden: int, intermediate: int, seq: int, shard_counts=(4, 16, 64), seed: int = 0):
    torch.manual_seed(seed)
    exact = SwiGLUMLP(hidden, intermediate, dtype=torch.float64)
    with torch.no_grad():
        for p in exact.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    x64, dy64 = make_inputs(seq, hidden, torch.float64, "cpu", seed=seed)
    reference = step_outputs(exact, exact, x64, dy64)

    low = SwiGLUMLP(hidden, intermediate, dtype=torch.bfloat16)
    low.load_state_dict(exact.state_dict())
    x, dy = x64.detach().bfloat16().requires_grad_(True), dy64.bfloat16()
    rows = [dict(impl="untiled bf16", num_shards=1, accum="bf16 (autograd)",
                 weight_grad_rel_err=_weight_grad_error(low, low, x, dy, reference))]
    for shards in shard_counts:
        for accum in (None, torch.float32):
            tiled = TiledMLP(low, num_shards=shards, path="fast", grad_accum_dtype=accum)
            rows.append(dict(impl="fast", num_shards=shards, accum="fp32" if accum else "bf16 (default)",
                             weight_grad_rel_err=_weight_grad_error(tiled, low, x, dy, reference)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=704)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args(argv)
    print(f"bf16 SwiGLU hidden={args.hidden} intermediate={args.intermediate} seq={args.seq}: "
          "max over weights of ||grad - grad_fp64|| / ||grad_fp64||")
    print("| implementation | shards | accumulator | weight-grad rel. error |\n|---|---|---|---|")
    for row in measure(args.hidden, args.intermediate, args.seq):
        print(f"| {row['impl']} | {row['num_shards']} | {row['accum']} | {row['weight_grad_rel_err']:.2e} |")


if __name__ == "__main__":
    main()
