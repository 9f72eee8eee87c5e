"""``tiled-mlp bench-norms``: what tiling the RMSNorms of checkpointed decoder layers costs a step in time
and saves in peak memory (CPU; the stack of ``bench-offload``)."""
from __future__ import annotations

import sys

import torch

from ..bench.norm_cost import format_cost, measure
from . import parsing
from .offload_cmd import check_heads, stack_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-norms", help="step time and peak memory with HF's RMSNorms and tiled ones",
                              description=__doc__)
    stack_arguments(p)
    p.add_argument("--dtype", type=parsing.dtype, default=torch.bfloat16,
                   help="default bfloat16 (in float32 HF's norm upcasts nothing, so there is nothing to save)")
    p.set_defaults(run=run_command)


def run_command(args, parser_error) -> int:
    check_heads(args, parser_error)
    cost = measure(args.layers, args.seq, args.hidden, args.intermediate, args.heads, args.rounds, args.dtype,
                   progress=lambda text: print(text, file=sys.stderr, flush=True))
    print("\n".join(format_cost(cost)))
    return 0
