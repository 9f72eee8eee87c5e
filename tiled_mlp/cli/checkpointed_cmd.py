"""``tiled-mlp bench-checkpointed``: checkpointed decoder-layer regions, untiled vs ours vs DeepSpeed."""
from __future__ import annotations

import importlib.util

import torch

from ..bench.checkpointed import IMPLS, REGIONS, format_rows, plot_rows, run
from ..bench.progress import Progress
from . import parsing


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench-checkpointed", help="time, memory and MLP forwards of checkpointed layers",
                              description=__doc__)
    p.add_argument("--regions", default=",".join(REGIONS), help=f"comma-separated: {', '.join(REGIONS)}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated: {', '.join(IMPLS)}")
    p.add_argument("--hidden", type=parsing.positive_int, default=1024)
    p.add_argument("--intermediate", type=parsing.positive_int, default=2816)
    p.add_argument("--seq", type=parsing.positive_int, default=8192)
    p.add_argument("--heads", type=parsing.positive_int, default=8)
    p.add_argument("--num-shards", type=parsing.shards, default="auto")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    p.add_argument("--dtype", type=parsing.dtype, default=torch.float32)
    p.add_argument("--repeats", type=parsing.positive_int, default=5, help="timed steps per cell (median)")
    p.add_argument("--plot", metavar="PNG")
    p.set_defaults(run=run_command)


def _names(text: str, known, what: str, parser_error) -> list:
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        parser_error(f"--{what} {text!r}: unknown or empty ({', '.join(unknown) or 'none given'}); known: {', '.join(known)}")
    return names


def run_command(args, parser_error) -> int:
    regions = _names(args.regions, REGIONS, "regions", parser_error)
    impls = _names(args.impls, IMPLS, "impls", parser_error)
    if "untiled" not in impls:
        parser_error("--impls must include untiled: every ratio is against it")
    if "deepspeed" in impls and importlib.util.find_spec("deepspeed") is None:
        parser_error("the deepspeed implementation needs deepspeed: pip install 'tiled-mlp[deepspeed]'")
    if "llama-layer" in regions and importlib.util.find_spec("transformers") is None:
        parser_error("the llama-layer region needs transformers: pip install 'tiled-mlp[hf]'")
    if "llama-layer" in regions:
        shape_error = parsing.attention_shape_error(args.hidden, args.heads, "--heads")
        if shape_error:
            parser_error(f"the llama-layer region: {shape_error}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser_error("--plot needs matplotlib: pip install 'tiled-mlp[bench]'")
    progress = Progress(len(regions) * (len(impls) + args.repeats), "bench-checkpointed")
    rows = []
    for region in regions:
        rows += run(region, impls, args.hidden, args.intermediate, args.seq, args.dtype, args.repeats, args.heads,
                    args.num_shards, progress.step, torch.device(args.device))
    progress.close()
    what = f"{args.device} {str(args.dtype).removeprefix('torch.')}"
    print(f"{what}, hidden {args.hidden}, intermediate {args.intermediate}, {args.seq} tokens, one non-reentrant "
          "checkpoint per region")
    print(format_rows(rows))
    if args.plot:
        plot_rows(rows, args.plot, what)
        print(f"plot written to {args.plot}")
    return 0
