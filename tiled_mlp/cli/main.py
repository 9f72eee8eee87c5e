"""Entry point of the ``tiled-mlp`` command."""
from __future__ import annotations

import argparse
import gc
import sys
from typing import List, NoReturn, Optional

from . import (
    bench_cmd,
    bench_loss_cmd,
    checkpointed_cmd,
    gpu_report_cmd,
    norms_cmd,
    offload_cmd,
    overhead_cmd,
    plan_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiled-mlp", description="Token-sharded MLPs for long-sequence training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (bench_cmd, bench_loss_cmd, checkpointed_cmd, offload_cmd, norms_cmd, overhead_cmd, plan_cmd,
                    gpu_report_cmd):
        command.add_parser(sub)
    try:
        from . import demo_cmd
    except ImportError:  # the demo needs transformers (the `hf` extra)
        pass
    else:
        demo_cmd.add_parser(sub)
    # Errors a command finds while checking its arguments (before any work) read like argparse's own
    # for that command: "tiled-mlp bench: error: ...", its usage, exit code 2.
    for command_parser in sub.choices.values():
        command_parser.set_defaults(parser_error=command_parser.error)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.parser_error)


def run() -> NoReturn:
    """The ``tiled-mlp`` command: what ``main()`` returns is the exit status, as ``sys.exit`` reads it (None:
    0; an int: itself; a message: printed on stderr, 1). The interpreter then exits the ordinary way: the
    ``atexit`` functions, the threads joined, the output buffers (Python's and C's), the modules' finalisation.
    The objects the command built are frozen first (``gc.freeze``): the collector then leaves them to the end
    of the process instead of tracing them at finalisation, about 1 s of CPU after ``plan`` (whose fake-tensor
    model loads some 2,100 modules, Dynamo's among them) that would free nothing the exit does not."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
