"""``tiled-mlp plan --model CONFIG``: a whole decoder model's training step at its full depth, per rank,
MLPs untiled vs tiled, the model's own loss vs the tiled loss, with and without checkpointing, the
total each holds with the optimizer state, and the longest sequence each setting fits into the budget
(``--budget``, default: this machine's GPU memory, else 80 GiB)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, NoReturn, Optional, Tuple

import torch

from tiled_core.shard_plan import NumShards

from ..bench.progress import Progress
from ..planner import check, report
from ..planner.advice import what_to_change
from ..planner.backends import BACKENDS, Backend
from ..planner.plan import Planner, Point, Request
from ..planner.presets import PRESETS, load_config
from ..planner.search import Longest
from ..planner.step import Setting

GiB = 2**30
DEFAULT_SEQS = [8192, 32768, 65536, 131072]
DEFAULT_BUDGET = 80 * GiB
# Progress slots per setting for the search; it usually needs two or three steps, and the bar is
# advanced to the end of a setting's slots when its search is done, so that it ends at 100%.
SEARCH_SLOTS = 6


def add_arguments(p) -> None:
    g = p.add_argument_group("whole model (--model)")
    g.add_argument("--model", default=None, metavar="CONFIG",
                   help=f"a preset ({', '.join(PRESETS)}) or a local config.json / folder")
    g.add_argument("--checkpointing", choices=("none", "layer", "both"), default="both",
                   help="non-reentrant checkpointing of every decoder layer: off, on, or both settings (default)")
    g.add_argument("--tiled", default="auto", help="none (untiled settings only), auto, or a shard count (default auto)")
    g.add_argument("--tiled-loss", default=None, metavar="SHARDS",
                   help="the tiled loss (LM head + cross-entropy by token shards, never the logits) beside the model's "
                        "own: none (own loss only), auto, or a shard count (default: auto where the integration knows "
                        "the model's loss path, else none, said so)")
    g.add_argument("--world-size", type=int, default=1, help="ranks; each runs --batch sequences (default 1)")
    g.add_argument("--backend", choices=BACKENDS, default=None,
                   help="how ranks divide weights, gradients and optimizer state (default: single, or fsdp2 with --world-size > 1)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="the optimizer state lives on the host: reported, not counted against --budget")
    g.add_argument("--plot", default=None, metavar="PNG", help="held memory against sequence length, budget and max lengths")


def default_budget() -> Tuple[int, str]:
    """The local accelerator's memory, else a stated 80 GiB; and where the number came from."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return int(props.total_memory), f"default: the total memory of cuda:0, {props.name}"
    return DEFAULT_BUDGET, "default: no CUDA device here, so 80 GiB (an H100's); set --budget"


def _settings(args, parser_error) -> List[Setting]:
    from .parsing import shards

    def off_and_on(flag: str, value: str) -> List[Optional[NumShards]]:
        """[None] for 'none', else [None, the shard count]: each knob's setting beside its absence."""
        if value == "none":
            return [None]
        try:
            return [None, shards(value)]
        except argparse.ArgumentTypeError as error:  # worded by the one shard-count parser
            parser_error(f"{flag} {value}: {error}")
            raise AssertionError("parser_error exits") from error

    ckpt = {"none": [False], "layer": [True], "both": [False, True]}[args.checkpointing]
    tiled = off_and_on("--tiled", args.tiled)
    losses = off_and_on("--tiled-loss", args.tiled_loss or "auto")
    return [Setting(tiled=n is not None, checkpointing=c, num_shards="auto" if n is None else n,
                    tiled_loss=loss is not None, loss_num_shards="auto" if loss is None else loss)
            for c in ckpt for loss in losses for n in tiled]


def run(args, parser_error) -> int:
    # Everything is checked before the first modelled step: a mistake must not cost a plan.
    if args.world_size < 1:
        parser_error(f"--world-size must be 1 or more, got {args.world_size}")
    backend_name = args.backend or ("single" if args.world_size == 1 else "fsdp2")
    if backend_name == "single" and args.world_size != 1:
        parser_error(f"--backend single runs one rank; --world-size {args.world_size} needs ddp, fsdp2 or zero3")
    if args.plot:
        from .bench_cmd import _check_plot

        _check_plot(args.plot, parser_error)
    settings = _settings(args, parser_error)
    seqs = list(dict.fromkeys(args.seq or DEFAULT_SEQS))
    budget, budget_from = (args.budget, "--budget") if args.budget is not None else default_budget()
    # Shown before transformers is imported (seconds): the bar is there at once.
    progress = Progress(2 + len(seqs) * len(settings) + SEARCH_SLOTS * len(settings), "plan", enabled=not args.json)

    def fail(message: str) -> NoReturn:
        progress.close()
        parser_error(message)
        raise AssertionError("parser_error exits")

    try:
        config = load_config(args.model)
        check.check_config(config)
    except ValueError as error:
        fail(str(error))
    progress.step("config")
    request = Request(config, seqs, settings, Backend(backend_name, args.world_size), args.batch, args.dtype, budget,
                      optimizer_on_device=not args.offload_optimizer)
    planner = Planner(request)
    warnings: List[str] = []
    problem = _check_model(args, planner, budget_from, warnings)
    if problem:
        fail(problem)
    for _ in range((len(seqs) + SEARCH_SLOTS) * (len(settings) - len(request.settings))):
        progress.step("tiled loss: left out")  # the left-out settings' slots, so that the bar ends at 100%
    progress.step("full-depth probe")
    points, longest, advice = _plan(planner, progress)
    progress.close()
    _output(args, planner, points, longest, advice, budget_from, warnings)
    return 0


def _leave_out_tiled_loss(args, planner: Planner, why: str, warnings: List[str]) -> str:
    """The tiled loss cannot be modelled for this model (``why``): by default its settings are left out,
    said in ``warnings`` (the rows without it are still worth having); asked for by --tiled-loss, that
    is the problem returned."""
    if args.tiled_loss is not None:
        return f"--tiled-loss {args.tiled_loss}: {why}; give --tiled-loss none"
    planner.request.settings = [s for s in planner.request.settings if not s.tiled_loss]
    warnings.append(f"the tiled-loss settings are left out: {why}")
    return ""


def _check_model(args, planner: Planner, budget_from: str, warnings: List[str]) -> str:
    """Why the model cannot be planned as asked ('' when it can), from its full-depth meta build and,
    last, one short step; what is left out of the plan is said in ``warnings``."""
    request, config = planner.request, planner.request.config
    try:
        model = check.build(config, args.dtype, lambda: planner.model(Setting(tiled=False, checkpointing=False)))
        sizes = planner.param_sizes()
    except ValueError as error:
        return f"--model {args.model}: {error}"
    limit = check.position_limit(model, config)
    if limit is not None:
        if max(request.seqs) > limit:
            return (f"--seq {max(request.seqs)}: {config.model_type} has learned position embeddings for {limit} "
                    f"tokens and cannot run longer sequences; give --seq up to {limit}")
        request.seq_cap = min(request.seq_cap, limit)
    backend, budget = request.backend, request.budget
    weights = backend.weight_bytes(sizes, args.dtype)
    if budget is not None and weights > budget:
        return (f"the budget, {budget / GiB:.2f} GiB ({budget_from}), is smaller than the weights alone on each rank "
                f"({weights / GiB:.2f} GiB: {sizes.total / 1e9:.2f}B parameters in {args.dtype}, "
                f"{backend.name} over {backend.world_size}); raise the budget or shard over more ranks")
    with_loss = next((s for s in request.settings if s.tiled_loss), None)
    refusal = check.tiled_loss_refusal(model) if with_loss is not None else ""
    if refusal:  # a family the integration does not know: said before any step
        problem = _leave_out_tiled_loss(args, planner, refusal, warnings)
        if problem:
            return problem
        with_loss = None
    try:
        check.probe(model, config)
    except ValueError as error:
        return f"--model {args.model}: {error}"
    if with_loss is None:
        return ""
    try:  # the tiled loss is code of its own on the loss path: probed on a setting the plan models
        check.probe(check.build(config, args.dtype, lambda: planner.model(with_loss)), config)
    except ValueError as error:
        return _leave_out_tiled_loss(args, planner, f"with the tiled loss, {error}", warnings)
    return ""


def _plan(planner: Planner, progress: Progress) -> Tuple[List[Point], Dict[str, Longest], List[str]]:
    """The table's points, each setting's longest sequence, and what to change when nothing fits."""
    request = planner.request
    planner.on_point = progress.step
    points = [planner.point(s, seq) for seq in request.seqs for s in request.settings]
    longest: Dict[str, Longest] = {}
    for setting in request.settings:
        used = [0]

        def counted(label: str, used=used) -> None:
            used[0] += 1
            if used[0] <= SEARCH_SLOTS:
                progress.step(label)

        planner.on_point = counted
        longest[setting.name] = planner.longest(setting)
        for _ in range(SEARCH_SLOTS - min(used[0], SEARCH_SLOTS)):
            progress.step(f"{setting.name}: longest found")
    planner.on_point = lambda label: None
    advice: List[str] = []
    if all(found.seq == 0 for found in longest.values()):
        best = min(request.settings, key=lambda s: planner.point(s, request.seq_step).held_bytes)
        advice = what_to_change(planner, best)
    return points, longest, advice


def _output(args, planner: Planner, points: List[Point], longest: Dict[str, Longest], advice: List[str],
            budget_from: str, warnings: List[str]) -> None:
    request = planner.request
    budget, backend = request.budget, request.backend
    assert budget is not None, "the CLI always plans against a budget"
    for warning in (warnings + report.position_warnings(request.config, request.seqs, longest)
                    + report.dips(planner.modelled())):
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        records = ([dict(budget_bytes=int(budget), budget_from=budget_from)] + [p.record() for p in points]
                   + [dict(setting=k, max_seq=v.seq, at_cap=v.at_cap) for k, v in longest.items()])
        print(json.dumps(records, indent=2))
    else:
        header = report.header(args.model, request.config, planner.param_sizes(), planner.layer_kinds(), args.dtype,
                               args.batch, backend)
        print("\n".join([header, *report.table(points, budget, budget_from), *report.longest_lines(longest, budget),
                         *advice, *report.notes(points, args.dtype, backend, request.optimizer_on_device)]))
    if args.plot:
        from ..planner.plot import plot_plan

        title = (f"{args.model}, {str(args.dtype).replace('torch.', '')}, {backend.name} x{backend.world_size}, "
                 f"batch {args.batch}")
        plot_plan(planner.modelled(), {k: v.seq for k, v in longest.items()}, budget, args.plot, title)
        print(f"plot: {args.plot}")
