"""``tiled-mlp bench --compile``: its argument checks (before any work) and its output; the measuring is in
``tiled_mlp.bench.compiled``."""
from __future__ import annotations

import shutil

import torch

from ..bench.compiled import CompileBenchConfig, format_compile_report, run_compile_bench
from . import json_stdout

# This mode's sizes where the user gave none (the size the compile targets were set at); the table mode keeps its own.
DEFAULTS = dict(hidden=1024, intermediate=2816, seq=[8192], compile_backend="inductor")


def _backends() -> list:
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def check(args, device: torch.device, parser_error) -> None:
    """Flags the mode cannot honour are refused by name, before anything is compiled."""
    for flag, given in (("--model-memory", args.model_memory), ("--impls", args.impls is not None),
                        ("--tp", args.tp != 1), ("--plot", args.plot is not None)):
        if given:
            parser_error(f"--compile measures its own four variants (eager/compiled x untiled/tiled) on real tensors; "
                         f"it cannot be combined with {flag}: drop {flag} or drop --compile")
    if len(args.seq) != 1:
        parser_error(f"--compile measures one sequence length, got {len(args.seq)} ({','.join(map(str, args.seq))}); "
                     "pass a single --seq")
    if args.compile_backend not in _backends():
        parser_error(f"unknown torch.compile backend {args.compile_backend!r}; available: {', '.join(_backends())}")
    if args.compile_backend == "inductor" and device.type == "cpu" and not (shutil.which("g++") or shutil.which("clang++")):
        parser_error("--compile-backend inductor on the CPU needs a C++ compiler (g++ or clang++) on PATH; "
                     "install one, or use --compile-backend aot_eager")


def run(args, dtype: torch.dtype) -> int:
    cfg = CompileBenchConfig(hidden=args.hidden, intermediate=args.intermediate, seq=args.seq[0], batch=args.batch,
                             dtype=dtype, device=args.device, num_shards=args.num_shards,
                             backend=args.compile_backend, repeats=args.repeats)
    config = dict(hidden=cfg.hidden, intermediate=cfg.intermediate, seq=cfg.seq, batch=cfg.batch,
                  dtype=str(dtype).replace("torch.", ""), device=cfg.device, num_shards=cfg.num_shards,
                  backend=cfg.backend, repeats=cfg.repeats, warmup=cfg.warmup, torch=torch.__version__)
    # Compilers and DeepSpeed may write to stdout: with --json it carries the document alone.
    with json_stdout.only_json(args.json):
        result = run_compile_bench(cfg, show_progress=not (args.no_progress or args.json))
        if args.json:
            json_stdout.emit(dict(config=config, **result))
        else:
            print(format_compile_report(result, config))
    return 0
