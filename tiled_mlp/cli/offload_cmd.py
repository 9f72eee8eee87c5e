"""``tiled-mlp bench-offload``: what checkpoint offload costs a step of checkpointed decoder layers (CPU)."""
from __future__ import annotations

import sys

from ..bench.offload_cost import format_cost, measure
from . import parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-offload", help="step time with and without checkpoint offload",
                              description=__doc__)
    p.add_argument("--layers", type=parsing.positive_int, default=4, help="checkpointed layers (>= 2)")
    p.add_argument("--seq", type=parsing.positive_int, default=8192)
    p.add_argument("--hidden", type=parsing.positive_int, default=1024)
    p.add_argument("--intermediate", type=parsing.positive_int, default=2816)
    p.add_argument("--heads", type=parsing.positive_int, default=8)
    p.add_argument("--rounds", type=parsing.positive_int, default=5, help="timed rounds after a warm-up round")
    p.set_defaults(run=run_command)


def run_command(args, parser_error) -> int:
    if args.layers < 2:
        parser_error("--layers must be >= 2: the last layer's input is never offloaded")
    if args.hidden % args.heads:
        parser_error(f"--heads {args.heads} does not divide --hidden {args.hidden}")
    cost = measure(args.layers, args.seq, args.hidden, args.intermediate, args.heads, args.rounds,
                   progress=lambda text: print(text, file=sys.stderr, flush=True))
    print("\n".join(format_cost(cost)))
    return 0
