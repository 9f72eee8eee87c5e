"""``tiled-mlp bench-overhead``: Python overhead per call on tiny shapes (pass-through and tiled)."""
from __future__ import annotations

from ..bench.overhead import HIDDEN, INTERMEDIATE, TOKENS, measure
from . import parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-overhead", help="Python overhead per TiledMLP call on tiny shapes",
                              description=__doc__)
    p.add_argument("--calls", type=parsing.positive_int, default=500, help="calls per timed block (median of 9)")
    p.set_defaults(run=run_command)


def run_command(args, parser_error) -> int:
    results = measure(args.calls)
    print(f"{TOKENS} tokens, hidden {HIDDEN}, intermediate {INTERMEDIATE}, fp32, 1 thread: microseconds per call")
    print("| measurement | us |")
    print("|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.1f} |")
    return 0
