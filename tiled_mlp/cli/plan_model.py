"""``tiled-mlp plan --model CONFIG``: a whole decoder model's training step, per rank, untiled vs tiled,
with and without checkpointing, and the longest sequence each setting fits into ``--budget``."""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional

import torch

from tiled_core.shard_plan import NumShards

from ..bench.progress import Progress
from ..planner.backends import BACKENDS, Backend
from ..planner.plan import IN_FLIGHT, LOGITS_KNOB, Planner, Point, Request
from ..planner.presets import load_config
from ..planner.step import Setting
from ..planner.timeline import LOGITS

GiB = 2**30
DEFAULT_SEQS = [8192, 32768, 65536, 131072]


def add_arguments(p) -> None:
    g = p.add_argument_group("whole model (--model)")
    g.add_argument("--model", default=None, metavar="CONFIG",
                   help="a preset (llama-3.1-8b, qwen2.5-7b, qwen3-30b-a3b, gemma-2-9b) or a local config.json / folder")
    g.add_argument("--checkpointing", choices=("none", "layer", "both"), default="both",
                   help="non-reentrant checkpointing of every decoder layer: off, on, or both settings (default)")
    g.add_argument("--tiled", default="auto", help="none (untiled settings only), auto, or a shard count (default auto)")
    g.add_argument("--world-size", type=int, default=1, help="ranks; each runs --batch sequences (default 1)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="how ranks divide weights, gradients and optimizer state (default: single, or fsdp2 with --world-size > 1)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="the optimizer state lives on the host: reported, not counted against --budget")
    g.add_argument("--plot", default=None, metavar="PNG", help="peak against sequence length, budget and max lengths")


def _settings(args, parser_error) -> List[Setting]:
    from .parsing import shards

    ckpt = {"none": [False], "layer": [True], "both": [False, True]}[args.checkpointing]
    tiled: List[Optional[NumShards]] = [None]
    if args.tiled != "none":
        try:
            tiled.append(shards(args.tiled))
        except argparse.ArgumentTypeError as error:  # worded by the one shard-count parser
            parser_error(f"--tiled {args.tiled}: {error}")
    return [Setting(tiled=n is not None, checkpointing=c, num_shards="auto" if n is None else n)
            for c in ckpt for n in tiled]


def run(args, parser_error) -> int:
    # Everything checked before the first modelled step.
    if args.world_size < 1:
        parser_error(f"--world-size must be 1 or more, got {args.world_size}")
    backend_name = args.backend or ("single" if args.world_size == 1 else "fsdp2")
    if backend_name == "single" and args.world_size != 1:
        parser_error(f"--backend single runs one rank; --world-size {args.world_size} needs ddp, fsdp2 or zero3")
    if args.plot:
        from .bench_cmd import _check_plot

        _check_plot(args.plot, parser_error)
    try:
        config = load_config(args.model)
    except ValueError as error:
        parser_error(str(error))
    settings = _settings(args, parser_error)
    backend = Backend(backend_name, args.world_size)
    budget = args.budget
    optimizer_counts = not args.offload_optimizer
    request = Request(config, args.seq or DEFAULT_SEQS, settings, backend, args.batch, args.dtype, budget,
                      optimizer_on_device=optimizer_counts)
    estimate = len(request.seqs) * len(settings) + (16 * len(settings) if budget else 0)
    progress = Progress(estimate, "plan", enabled=not args.json)
    planner = Planner(request, on_point=progress.step)
    sizes = planner.param_sizes()
    weights = backend.weight_bytes(sizes, args.dtype)
    if budget is not None and weights > budget:
        progress.close()
        parser_error(f"--budget {budget / GiB:.2f} GiB is smaller than the weights alone on each rank "
                     f"({weights / GiB:.2f} GiB: {sizes.total / 1e9:.2f}B parameters in {args.dtype}, "
                     f"{backend.name} over {args.world_size}); raise the budget or shard over more ranks")
    points: List[Point] = [planner.point(s, seq) for seq in request.seqs for s in settings]
    max_seq: Dict[str, int] = {}
    if budget is not None:
        for s in settings:
            max_seq[s.name] = planner.max_seq(s)
    progress.close()
    if args.json:
        records = [p.record() for p in points] + [dict(setting=k, max_seq=v) for k, v in max_seq.items()]
        print(json.dumps(records, indent=2))
    else:
        _print(args, config, sizes, backend, points, max_seq, optimizer_counts)
    if args.plot:
        from ..planner.plot import plot_plan

        every = planner.modelled()
        title = f"{args.model}, {str(args.dtype).replace('torch.', '')}, {backend.name} x{backend.world_size}, batch {args.batch}"
        plot_plan(every, max_seq, budget, args.plot, title)
        print(f"plot: {args.plot}")
    return 0


def _print(args, config, sizes, backend, points, max_seq, optimizer_counts) -> None:
    text = config.get_text_config()
    print(f"{args.model}: {sizes.total / 1e9:.2f}B parameters, {text.num_hidden_layers} layers, vocabulary {text.vocab_size}; "
          f"{str(args.dtype).replace('torch.', '')}, batch {args.batch} per rank, {backend.name} x{backend.world_size}")
    print("peak per rank in GiB (weights, gradients, activations of one step; modelled on the meta device)")
    print("| seq | setting | peak | optimizer | fits | dominant term |")
    print("|---|---|---|---|---|---|")
    for p in points:
        fits = "-" if p.fits is None else ("yes" if p.fits else "no")
        share = p.parts[p.dominant] / p.peak_bytes
        print(f"| {p.seq} | {p.setting} | {p.peak_bytes / GiB:.2f} | {p.optimizer_bytes / GiB:.2f} | {fits} | "
              f"{p.dominant} ({share:.0%}) |")
    if max_seq:
        print(f"longest sequence within {args.budget / GiB:.0f} GiB per rank (bisection on the modelled step, "
              f"multiples of 1024):")
        for setting, seq in max_seq.items():
            print(f"  {setting:13s} {seq:>9,} tokens" if seq else f"  {setting:13s} none (not even 1024 tokens)")
    if any(p.dominant == LOGITS for p in points):
        print(f"note: the logits and the loss dominate where marked; the knob that removes them is {LOGITS_KNOB}.")
    print("analytic, not modelled: the optimizer state (Adam, float32 moments"
          + ("" if args.dtype == torch.float32 else " and master weights")
          + (", on the host" if not optimizer_counts else "") + ")"
          + ("" if backend.name == "single" else f", and {backend.name}'s division of weights and gradients and its "
             f"'{IN_FLIGHT}' buffers (tiled_mlp/planner/backends.py)") + ".")
