"""``tiled-mlp bench-offload``: what checkpoint offload costs a step of checkpointed decoder layers (CPU)."""
from __future__ import annotations

import sys

from ..bench.offload_cost import format_cost, measure
from . import parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-offload", help="step time with and without checkpoint offload",
                              description=__doc__)
    stack_arguments(p)
    p.set_defaults(run=run_command)


def stack_arguments(p) -> None:
    """The benchmarked stack of checkpointed Llama layers (``offload_cost.llama_stack``): shared by bench-norms."""
    p.add_argument("--layers", type=parsing.positive_int, default=4,
                   help="checkpointed layers (bench-offload: >= 2, the last layer's input is never offloaded)")
    p.add_argument("--seq", type=parsing.positive_int, default=8192)
    p.add_argument("--hidden", type=parsing.positive_int, default=1024)
    p.add_argument("--intermediate", type=parsing.positive_int, default=2816)
    p.add_argument("--heads", type=parsing.positive_int, default=8)
    p.add_argument("--rounds", type=parsing.positive_int, default=5, help="timed rounds after a warm-up round")


def check_heads(args, parser_error) -> None:
    if args.hidden % args.heads:
        parser_error(f"--heads {args.heads} does not divide --hidden {args.hidden}")


def run_command(args, parser_error) -> int:
    if args.layers < 2:
        parser_error("--layers must be >= 2: the last layer's input is never offloaded")
    check_heads(args, parser_error)
    cost = measure(args.layers, args.seq, args.hidden, args.intermediate, args.heads, args.rounds,
                   progress=lambda text: print(text, file=sys.stderr, flush=True))
    print("\n".join(format_cost(cost)))
    return 0
