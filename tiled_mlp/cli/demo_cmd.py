"""``tiled-mlp demo``: train a tiny Llama tiled and untiled on synthetic long sequences (CPU).

With ``--nproc N --strategy fsdp2|deepspeed`` it launches N ranks through torchrun with gloo.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from . import parsing
from .demo_train import HEADS, add_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a tiny Llama tiled vs untiled (loss and peak memory per step)",
                              description=__doc__)
    add_arguments(p)
    p.add_argument("--nproc", type=parsing.positive_int, default=1, help="ranks to launch with torchrun (CPU, gloo)")
    p.set_defaults(run=run)


def _passthrough(args) -> list:
    out = []
    for name in ("seq", "batch", "steps", "hidden", "intermediate", "layers", "vocab", "num_shards", "lr", "seed", "sp"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.strategy:
        out += ["--strategy", args.strategy]
    return out


def run(args, parser_error) -> int:
    if importlib.util.find_spec("transformers") is None:
        parser_error("the demo needs transformers: pip install 'tiled-mlp[hf]'")
    shape_error = parsing.attention_shape_error(args.hidden, HEADS, "the demo's attention heads")
    if shape_error:
        parser_error(shape_error)
    if args.strategy and args.nproc < 2:
        parser_error(f"--strategy {args.strategy} needs --nproc 2 or more")
    if args.strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        parser_error("--strategy deepspeed needs deepspeed: pip install 'tiled-mlp[deepspeed]'")
    if args.sp > 1:
        if args.nproc != args.sp:  # the one-process run it is compared with trains one sequence a step
            parser_error(f"--sp {args.sp} needs --nproc {args.sp} (one sequence shared by every rank; got --nproc {args.nproc})")
        if HEADS % args.sp or args.seq % args.sp:
            parser_error(f"--sp {args.sp} must divide the demo's {HEADS} attention heads and --seq {args.seq}")
        if importlib.util.find_spec("deepspeed") is None:
            parser_error("--sp needs deepspeed (its Ulysses attention): pip install 'tiled-mlp[deepspeed]'")
    if args.nproc == 1:
        from .demo_train import report

        report(args, rank=0)
        return 0
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "tiled_mlp.cli.demo_train", *_passthrough(args)]
    return subprocess.call(command)
