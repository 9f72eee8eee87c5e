"""``tiled-mlp bench``: the seed's experiment table for one MLP size, ours against untiled and peers."""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

from ..bench.impls import available_impls
from ..bench.model_memory import modeled_peak_bytes, modeled_step
from ..bench.report import format_table, plot, to_json
from ..bench.runner import BenchConfig, run_bench
from . import bench_compile_cmd, parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time and memory of tiled vs untiled MLP over sequence lengths",
                              description=__doc__)
    # Defaults are filled in by run(): --compile has its own (bench_compile_cmd.DEFAULTS).
    p.add_argument("--hidden", type=parsing.positive_int, default=None, help="default 512 (1024 with --compile)")
    p.add_argument("--intermediate", type=parsing.positive_int, default=None, help="default 1408 (2816 with --compile)")
    p.add_argument("--seq", type=parsing.seq_list, default=None,
                   help="comma-separated sequence lengths (default 1024,2048,4096,8192; 8192 with --compile)")
    p.add_argument("--batch", type=parsing.positive_int, default=1)
    p.add_argument("--dtype", type=parsing.dtype, default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    p.add_argument("--device", default="cpu", help="cpu, cuda, npu, ...")
    p.add_argument("--num-shards", type=parsing.shards, default="auto", help="an int >= 1 or auto (default)")
    p.add_argument("--impls", default=None,
                   help="comma-separated implementations to compare: " + ", ".join(available_impls()) +
                        " (default: untiled, auto, and deepspeed when installed)")
    p.add_argument("--repeats", type=parsing.positive_int, default=5, help="timed steps per cell (median)")
    p.add_argument("--model-memory", action="store_true",
                   help="model peak memory with fake tensors (no allocation, no timing): any size on any machine")
    p.add_argument("--tp", type=parsing.positive_int, default=1,
                   help="with --model-memory: one rank of tensor parallelism over N ranks (local weights, its collectives)")
    p.add_argument("--compile", action="store_true",
                   help="eager vs torch.compile, untiled vs tiled, at one length: time ratios against the "
                        "compile targets, allocator peaks, gradient error, dynamo graph breaks")
    p.add_argument("--compile-backend", default=None, help="with --compile: torch.compile backend "
                   "(default inductor; aot_eager traces the same graphs without generating code, for a fast check)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", metavar="PNG", help="draw memory (and time) against sequence length")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def _impls(arg, parser_error) -> list:
    available = available_impls()
    if arg is None:
        return [i for i in ("untiled", "auto", "deepspeed") if i in available]
    names = list(dict.fromkeys(n.strip() for n in arg.split(",") if n.strip()))
    if not names:
        parser_error(f"--impls names no implementation (got {arg!r}); available: {', '.join(available)}")
    unknown = [n for n in names if n not in available]
    if unknown:
        parser_error(f"unknown or unavailable implementation(s) {', '.join(unknown)}; available: {', '.join(available)}")
    return names


def _check_plot(path: str, parser_error) -> None:
    """Everything that would make the plot fail after the benchmark ran: no matplotlib, no folder, a format."""
    if importlib.util.find_spec("matplotlib") is None:
        parser_error("--plot needs matplotlib: pip install 'tiled-mlp[bench]'")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser_error(f"--plot {path}: no such folder {folder}")
    extension = os.path.splitext(path)[1][1:].lower()
    if extension:  # none: matplotlib writes PNG
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if extension not in formats:
            parser_error(f"--plot {path}: matplotlib cannot write {extension!r} files; "
                         f"use one of {', '.join(sorted(formats))}")


def _check_fake_device(args, dtype, impls, parser_error) -> None:
    """--model-memory on a device that is not here: torch must still be able to fake its tensors."""
    # "auto" runs untiled at the probe's size: probe the tiled path it takes at real sizes instead.
    for impl in dict.fromkeys("fast" if i == "auto" else i for i in impls):
        try:
            modeled_step(impl, 8, 16, 4, dtype, 2, 1, args.device)  # a few bytes, on fake tensors
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            parser_error(f"--model-memory cannot model device {args.device!r} in this torch build ({reason}); "
                         "use --device cpu")


def _device_memory(device: torch.device) -> Optional[int]:
    """All the memory ``device`` has (the host's physical memory for the CPU); None where unknown."""
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    return None


def _check_memory(args, device: torch.device, dtype: torch.dtype, parser_error) -> None:
    """A real run whose untiled step at the longest length cannot fit the device even in principle
    (modelled with fake tensors: a lower bound of what the run allocates) is refused before it starts."""
    have = _device_memory(device)
    if have is None:
        return
    seq = max(args.seq)
    need = modeled_peak_bytes("untiled", args.hidden, args.intermediate, seq, dtype, 1, args.batch)
    if need > have:
        gib = 2**30
        where = "this machine's memory" if device.type == "cpu" else f"{device}'s memory"
        parser_error(f"--hidden {args.hidden} --intermediate {args.intermediate} at {seq} tokens: one untiled step needs "
                     f"{need / gib:,.1f} GiB (modelled), more than {where} ({have / gib:,.1f} GiB); use smaller "
                     "sizes, or --model-memory to model them without allocating")


def _fill_defaults(args) -> None:
    defaults = bench_compile_cmd.DEFAULTS if args.compile else dict(hidden=512, intermediate=1408,
                                                                      seq=[1024, 2048, 4096, 8192])
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def run(args, parser_error) -> int:
    # Every argument is checked before the benchmark starts: a mistake must not cost a run.
    _fill_defaults(args)
    try:
        device = parsing.check_device(args.device, model_memory=args.model_memory)
    except ValueError as error:
        parser_error(str(error))
    dtype = args.dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if args.compile:
        bench_compile_cmd.check(args, device, parser_error)
        _check_memory(args, device, dtype, parser_error)
        return bench_compile_cmd.run(args, dtype)
    if args.compile_backend is not None:
        parser_error("--compile-backend chooses the backend of --compile: add --compile")
    impls = _impls(args.impls, parser_error)
    if args.plot:
        _check_plot(args.plot, parser_error)
    if args.model_memory and device.type != "cpu":
        _check_fake_device(args, dtype, ["untiled"] + impls, parser_error)
    if args.tp > 1 and not args.model_memory:
        parser_error("--tp models one tensor-parallel rank: it needs --model-memory")
    if args.intermediate % args.tp:
        parser_error(f"--tp {args.tp} needs an --intermediate divisible by it, got {args.intermediate}")
    if not args.model_memory:
        _check_memory(args, device, dtype, parser_error)
    cfg = BenchConfig(hidden=args.hidden, intermediate=args.intermediate, seqs=args.seq, dtype=dtype,
                      device=args.device, num_shards=args.num_shards, impls=impls,
                      repeats=args.repeats, batch=args.batch, model_memory=args.model_memory, tp=args.tp)
    rows = run_bench(cfg, show_progress=not (args.no_progress or args.json))
    config = dict(hidden=cfg.hidden, intermediate=cfg.intermediate, seqs=cfg.seqs, dtype=str(dtype).replace("torch.", ""),
                  device=cfg.device, batch=cfg.batch, num_shards=cfg.num_shards, impls=cfg.impls,
                  model_memory=cfg.model_memory, tp=cfg.tp, torch=torch.__version__)
    kind = "modelled with fake tensors" if cfg.model_memory else f"measured on {cfg.device}"
    if cfg.tp > 1:
        kind += f", one rank of tensor parallelism over {cfg.tp} (local weights, its all-reduce buffers)"
    if args.json:
        print(to_json(rows, config))
    else:
        print(f"SwiGLU MLP hidden={cfg.hidden} intermediate={cfg.intermediate} {config['dtype']} batch={cfg.batch}, "
              f"fwd+bwd, memory {kind} (input, grad_output, weights and grads included)")
        print(format_table(rows, tiled="auto" if "auto" in cfg.impls else cfg.impls[-1]))
    if args.plot:
        plot(rows, args.plot, f"SwiGLU {cfg.hidden}/{cfg.intermediate} {config['dtype']}, memory {kind}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
