"""``tiled-mlp bench-loss``: the causal-LM loss and its backward (dx and dW), untiled (Hugging Face) against
torch's chunked ``F.linear_cross_entropy``, DeepSpeed's ``TiledFusedLogitsLoss`` and ours
(``tiled_cross_entropy``): full-size peak memory (fake tensors), CPU time, gradient error."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys

from ..bench.loss_report import format_report, plot_report
from ..bench.loss_runner import LossBenchConfig, run_loss_bench, total_steps
from ..bench.loss_tp_memory import format_tp_report, vocab_parallel_peak
from ..bench.progress import Progress
from . import parsing
from .bench_cmd import _check_plot

DEFAULT_PLOT = "bench_loss.png"
# --quick: every measurement small (a test, a first look).
QUICK = LossBenchConfig(memory_size=(8192, 256, 32000), time_size=(512, 64, 2000), accuracy_size=(256, 32, 1000), rounds=1)


def size(text: str):
    """'tokens,hidden,vocab' -> (int, int, int), each a positive integer."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected tokens,hidden,vocab (e.g. 8192,1024,32000), got {text!r}")
    try:
        return tuple(parsing.positive_int(p) for p in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"tokens,hidden,vocab must be positive integers, got {text!r}") from None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-loss", help="memory, time and gradient error of tiled vs untiled causal-LM loss",
                              description=__doc__)
    defaults = LossBenchConfig()
    p.add_argument("--memory-size", type=size, default=None, metavar="T,H,V",
                   help=f"fake-tensor peak memory size, bf16 (default {_text(defaults.memory_size)})")
    p.add_argument("--time-size", type=size, default=None, metavar="T,H,V",
                   help=f"CPU timing size, fp32 (default {_text(defaults.time_size)})")
    p.add_argument("--accuracy-size", type=size, default=None, metavar="T,H,V",
                   help=f"gradient-error size, fp32 (default {_text(defaults.accuracy_size)})")
    p.add_argument("--rounds", type=parsing.positive_int, default=None,
                   help=f"timed rounds, each running every method once (default {defaults.rounds})")
    p.add_argument("--quick", action="store_true", help="small sizes and one round (sizes given still win)")
    p.add_argument("--plot", metavar="PNG", default=None, help=f"where to draw the plot (default {DEFAULT_PLOT})")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tensor-parallel", type=parsing.positive_int, default=None, metavar="TP",
                   help="only the per-rank peak of the vocabulary-parallel loss (lm_head under ColwiseParallel over TP "
                        "ranks, a fake process group) at --memory-size, against x + dx + the rank's W and dW + one shard")
    p.set_defaults(run=run)


def _text(size) -> str:
    return ",".join(map(str, size))


def _config(args) -> LossBenchConfig:
    given = {name: getattr(args, name) for name in ("memory_size", "time_size", "accuracy_size", "rounds")
             if getattr(args, name) is not None}
    return dataclasses.replace(QUICK if args.quick else LossBenchConfig(), **given)


def _plot_path(args, parser_error):
    """The PNG to write, or None. The default is skipped without matplotlib; a path asked for is an error."""
    if args.no_plot:
        if args.plot:
            parser_error("--plot and --no-plot contradict each other")
        return None
    if args.plot is None and importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot (pip install 'tiled-mlp[bench]')", file=sys.stderr)
        return None
    path = args.plot or DEFAULT_PLOT
    _check_plot(path, parser_error)  # before the run: a bad path must not cost one
    return path


def run(args, parser_error) -> int:
    if args.tensor_parallel is not None:
        return _run_tensor_parallel(args)
    plot_path = _plot_path(args, parser_error)
    cfg = _config(args)
    progress = Progress(total_steps(cfg.rounds), "bench-loss", enabled=not (args.no_progress or args.json))
    try:
        result = run_loss_bench(cfg, on_step=progress.step)
    finally:
        progress.close()
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    if plot_path:
        plot_report(result, plot_path)
        print(f"plot written to {plot_path}", file=sys.stderr)
    return 0


def _run_tensor_parallel(args) -> int:
    cfg = _config(args)
    result = vocab_parallel_peak(*cfg.memory_size, args.tensor_parallel, cfg.memory_dtype)
    print(json.dumps(result, indent=2) if args.json else format_tp_report(result))
    return 0
