"""Entry point of the ``tiled-mlp`` command."""
from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import sys
from typing import List, NoReturn, Optional

from . import bench_cmd, bench_loss_cmd, checkpointed_cmd, norms_cmd, offload_cmd, overhead_cmd, plan_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiled-mlp", description="Token-sharded MLPs for long-sequence training.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (bench_cmd, bench_loss_cmd, checkpointed_cmd, offload_cmd, norms_cmd, overhead_cmd, plan_cmd):
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
    """The ``tiled-mlp`` command: ``main()``, then out of the process without finalising the interpreter.

    Finalising the modules of torch, transformers and DeepSpeed takes about 0.9 s after the answer is out
    (of a 7.9 s ``plan --model llama-3.1-8b``), time nothing needs; mypy's command leaves the same way.
    What an exit must do is done first: the functions registered with ``atexit`` (logging's flush,
    multiprocessing's joins, temporary directories' removal), then Python's and C's output buffers. Not
    done: joining non-daemon threads and ``threading``'s own exit callbacks (no command leaves either).
    The exit code is read as ``sys.exit`` reads it; an error (an exception, argparse's exit) leaves the
    ordinary way."""
    code = _exit_code(main())
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left (``| head``): the interpreter's own code for it
        code = 120
    _flush_c_stdio()
    os._exit(code)


def _exit_code(returned: object) -> int:
    if returned is None:
        return 0
    if isinstance(returned, int):
        return int(returned)
    print(returned, file=sys.stderr)
    return 1


def _flush_c_stdio() -> None:
    """What C code printed through ``stdio`` (a C++ extension's ``printf``), which ``os._exit`` drops."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library by that name (Windows): nothing buffered there to lose
        pass


if __name__ == "__main__":
    run()
