"""``tiled-mlp plan --model CONFIG``: a whole decoder model's training step at its full depth, per rank,
MLPs untiled vs tiled, the model's own loss vs the tiled loss, with and without checkpointing (and with
the checkpoints offloaded to the host, --offload-checkpoints), under Ulysses sequence parallelism
(--sp N), the total each holds on the device with the optimizer state and what it holds on the host,
and the longest sequence each setting fits into the budget (``--budget``, default: this machine's GPU
memory, else 80 GiB). ``tiled-mlp plan --alst``: ALST's ladder for Llama-3.1-8B beside ALST's figures."""
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Dict, List, NoReturn, Optional, Tuple

import torch

from tiled_mlp.core import auto_shards
from tiled_mlp.core.shard_plan import NumShards

from ..bench.progress import Progress
from ..planner import alst, attention, check, report, sequence_parallel, tensor_parallel, workers
from ..planner.advice import what_to_change
from ..planner.backends import BACKENDS, Backend
from ..planner.collector import collector_paused
from ..planner.plan import Planner, Point, Request
from ..planner.presets import PRESETS, load_config
from ..planner.search import Longest
from ..planner.settings_side_by_side import plan_settings
from ..planner.step import Setting
from . import json_stdout, parsing

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
    g.add_argument("--offload-checkpoints", action="store_true",
                   help="beside each checkpointed setting, the same with checkpoint offload ('+offload': every "
                        "checkpointed layer's input but the last's waits in host memory; apply_checkpoint_offload)")
    g.add_argument("--tiled-norms", action="store_true",
                   help="beside each setting that tiles the MLPs, the same with the hidden-size RMSNorms tiled too "
                        "('+norms', apply_tiled_mlp(norms=True), with the MLPs' shard count)")
    g.add_argument("--verify-full-depth", action="store_true",
                   help="model each longest length (and one grid step more) again with every layer stepped, and "
                        "check it equals the step composed from 2- and 3-layer steps (about 2x the time; the "
                        "composition's exactness is what tests/planner/test_planner_compose.py proves)")
    g.add_argument("--offload-params", action="store_true",
                   help="ZeRO-3 with the parameters on the host too (offload_param and offload_optimizer to the CPU, "
                        "as ALST's one-GPU run); implies --backend zero3 and --offload-optimizer")
    g.add_argument("--sp", type=int, default=1, metavar="N",
                   help="Ulysses sequence parallelism over N ranks (DeepSpeed's UlyssesSPAttentionHF): each rank runs "
                        "seq / N tokens, the attention all of them with heads / N; N divides the query heads, every "
                        "--seq and --world-size (default 1)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism over N ranks (DTensor's parallelize_module with torchtitan's Llama plan: "
                        "q/k/v/gate/up column-wise, o/down row-wise, the LM head by the vocabulary with a "
                        "vocabulary-parallel loss); each rank runs every token with 1/N of those weights. --world-size "
                        "counts all ranks: the backend divides over --world-size / N. The tiling goes on after the plan, as "
                        "apply_tiled_mlp on a parallelized model: the MLPs' fast kernel on each rank's share, the "
                        "tiled loss split over the vocabulary (default 1)")
    g.add_argument("--host-budget", type=parsing.byte_size, default=None, metavar="SIZE",
                   help="host memory each rank may use (a node's over the ranks on it), same forms as --budget: the "
                        "longest sequence then fits the host too (default: not limited). With --alst: a node's host "
                        "memory, shared by each row's ranks")
    g.add_argument("--attention", choices=attention.CHOICES, default=None,
                   help="the attn_implementation the training run uses, modelled with the masks transformers builds for "
                        "it: sdpa (a [tokens, tokens] mask on sliding-window layers), flash_attention_2, eager ([tokens, "
                        "tokens] scores on every layer) (default: what transformers picks for the config, said in the "
                        "output)")
    g.add_argument("--alst", action="store_true",
                   help="ALST's ladder: Llama-3.1-8B at 80 GiB a rank (or --budget), each row of ALST's ablation "
                        "beside the length ALST measured (other options but --budget, --host-budget and --workers are ignored; --json for records)")
    g.add_argument("--plot", default=None, metavar="PNG", help="held memory against sequence length, budget and max lengths")
    g.add_argument("--workers", type=parsing.positive_int, default=None, metavar="N",
                   help="processes that model the settings (with --alst, the rows) side by side, forked from the "
                        "planner, each holding its own steps' logs (about 1.5 GiB at ALST's million-token rows) "
                        "(default: the CPUs this process may use; 1: all in this process). The plan is the same for any N")


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
    # Checkpoint offload beside each checkpointed setting, as the other knobs are planned beside their absence.
    offloads = lambda c: [False, True] if c and args.offload_checkpoints else [False]  # noqa: E731
    # The tiled norms beside each setting with tiled MLPs (their shard count is the MLPs').
    norms = lambda n: [False, True] if n is not None and args.tiled_norms else [False]  # noqa: E731
    if args.tiled_norms and tiled == [None]:
        parser_error("--tiled-norms is planned beside the settings that tile the MLPs; --tiled none has none")
    return [Setting(tiled=n is not None, checkpointing=c, num_shards="auto" if n is None else n,
                    tiled_loss=loss is not None, loss_num_shards="auto" if loss is None else loss,
                    offload_checkpoints=o, sp=args.sp, tiled_norms=t, tp=args.tp)
            for c in ckpt for o in offloads(c) for loss in losses for n in tiled for t in norms(n)]


def _check_parallel(args, parser_error) -> str:
    """The backend's name, after the checks of what --world-size, --backend, --sp, --offload-params and
    --offload-checkpoints ask together (none of them needs the model)."""
    if args.world_size < 1:
        parser_error(f"--world-size must be 1 or more, got {args.world_size}")
    if args.offload_params and args.backend not in (None, "zero3"):
        parser_error(f"--offload-params is ZeRO-3's offload_param; --backend {args.backend} has none: give --backend "
                     "zero3 (or leave --backend out)")
    tensor_parallel.check_ranks(args.tp, args.sp, args.world_size, args.backend or ("zero3" if args.offload_params else None),
                                parser_error)
    data_parallel = args.world_size // args.tp
    backend_name = args.backend or ("zero3" if args.offload_params else "single" if data_parallel == 1 else "fsdp2")
    if backend_name == "single" and data_parallel != 1:
        parser_error(f"--backend single runs one rank; --world-size {args.world_size} needs ddp, fsdp2 or zero3")
    if args.sp < 1:
        parser_error(f"--sp must be 1 or more, got {args.sp}")
    if args.sp > 1:
        if args.world_size % args.sp:
            parser_error(f"--sp {args.sp}: sequence parallelism runs on groups of {args.sp} ranks; --world-size "
                         f"{args.world_size} is not a multiple of {args.sp}")
        bad = [seq for seq in (args.seq or DEFAULT_SEQS) if seq % args.sp]
        if bad:
            parser_error(f"--sp {args.sp}: {', '.join(map(str, bad))} tokens do not split across {args.sp} ranks; give "
                         f"lengths that are multiples of {args.sp}")
    if args.offload_checkpoints and args.checkpointing == "none":
        parser_error("--offload-checkpoints moves the input each checkpointed layer keeps to host memory; with "
                     "--checkpointing none there is none: give --checkpointing layer or both")
    return backend_name


def run(args, parser_error) -> int:
    with collector_paused():
        return _run(args, parser_error)


def _run(args, parser_error) -> int:
    # Everything is checked before the first modelled step: a mistake must not cost a plan.
    backend_name = _check_parallel(args, parser_error)
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
        sequence_parallel.check(config, args.sp)
        tensor_parallel.check(config, args.tp)
    except ValueError as error:
        fail(str(error))
    attention_choice, attention_from = _attention(args, config, fail)
    progress.step("config")
    # Under TP the backend divides each rank's TP shares over the data-parallel ranks (--world-size / --tp).
    backend = Backend(backend_name, args.world_size // args.tp, offload_params=args.offload_params)
    request = Request(config, seqs, settings, backend,
                      args.batch, args.dtype, budget,
                      optimizer_on_device=not (args.offload_optimizer or args.offload_params),
                      host_budget=args.host_budget, attention=attention_choice, gpu=True,
                      verify_full_depth=args.verify_full_depth)
    request.seq_step = math.lcm(request.seq_step, args.sp)  # the search's grid: lengths the SP ranks split
    planner = Planner(request)
    warnings: List[str] = []
    problem = _check_model(args, planner, budget_from, warnings)
    if problem:
        fail(problem)
    for _ in range((len(seqs) + SEARCH_SLOTS) * (len(settings) - len(request.settings))):
        progress.step("tiled loss: left out")  # the left-out settings' slots, so that the bar ends at 100%
    progress.step("probe")
    points, longest, advice = _plan(planner, progress, args.workers or workers.available())
    progress.close()
    _output(args, planner, points, longest, advice, budget_from, warnings, attention_from)
    return 0


def _attention(args, config, fail) -> Tuple[str, str]:
    """The attention modelled (--attention, else what transformers picks for the config) and where that
    choice came from; refused where transformers would not run it or the plan cannot model it."""
    if args.attention is not None:
        choice, source = args.attention, "--attention"
    else:
        choice, source = attention.default_for(config)
    why = attention.refusal(config, choice)
    if why:
        fail(f"attention {choice} ({source}): {why}")
    if args.sp > 1 and choice == attention.EAGER:
        fail(f"--sp {args.sp} with eager attention ({source}) is not modelled: under DeepSpeed's UlyssesSPAttentionHF the "
             "plan models a fused causal kernel over the whole sequence; give --attention sdpa or flash_attention_2")
    if args.sp > 1 and choice == attention.SDPA and attention.sliding_window(config) is not None:
        fail(f"--sp {args.sp} with sdpa on a model with sliding-window layers ({source}) is not modelled: "
             "apply_sequence_parallel rebuilds the whole sequence's mask after the all-to-all, the plan's step runs "
             "DeepSpeed's attention without one; give --attention flash_attention_2")
    return choice, source


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
    last, short steps (probes); what is left out of the plan is said in ``warnings``."""
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
        request.seq_cap = min(request.seq_cap, limit // args.sp)  # the cap is per rank (``Planner.seq_cap``)
    backend, budget = request.backend, request.budget
    weights = backend.weight_bytes(sizes, args.dtype)
    if budget is not None and weights > budget:
        return (f"the budget, {budget / GiB:.2f} GiB ({budget_from}), is smaller than the weights alone on each rank "
                f"({weights / GiB:.2f} GiB: {sizes.total / 1e9:.2f}B parameters in {args.dtype}, "
                f"{backend.name} over {backend.world_size}); raise the budget or shard over more ranks")
    if args.tp > 1:
        why = tensor_parallel.refusal(model)
        if why:
            return f"--tp {args.tp}: {why}"
    if args.sp > 1:
        # Only what apply_sequence_parallel accepts: the model (asked of the library's checks) and the
        # settings with the tiled loss, which SP requires.
        why = sequence_parallel.refusal(model)
        if why:
            return f"--sp {args.sp}: {why}"
        if args.tiled_loss == "none":
            return (f"--sp {args.sp} --tiled-loss none: apply_sequence_parallel requires the tiled loss (the SP loss is "
                    "its sum across the ranks); leave --tiled-loss out or give auto or a shard count")
        request.settings = [s for s in request.settings if s.tiled_loss]
        warnings.append(f"--sp {args.sp}: only the tiled-loss settings are planned (apply_sequence_parallel "
                        "requires the tiled loss)")
    with_loss = next((s for s in request.settings if s.tiled_loss), None)
    refusal = check.tiled_loss_refusal(model) if with_loss is not None else ""
    if refusal:  # a family the integration does not know: said before any step
        problem = _leave_out_tiled_loss(args, planner, refusal, warnings)
        if problem:
            return problem
        with_loss = None
    # The full-depth model's step, so that what only a deep model breaks (a layer by its index) breaks here.
    try:
        check.probe(model, config)
    except ValueError as error:
        return f"--model {args.model}: {error}"
    # SP, checkpoint offload, the tiled norms and the tiled loss are code of their own on the step: probed on
    # the first setting with each, on the model its steps run first (``Planner.stepped_first``: two layers
    # where the step is composed from shallow ones), which the plan then reuses.
    firsts = [next((s for s in request.settings if s.sp > 1), None),
              next((s for s in request.settings if s.offload_checkpoints), None),
              next((s for s in request.settings if s.tiled_norms), None)]
    for parallel in dict.fromkeys(s for s in firsts if s is not None):
        try:
            check.probe(check.build(config, args.dtype, functools.partial(planner.stepped_first, parallel)), config)
        except ValueError as error:
            return f"--model {args.model}, {parallel.name}: {error}"
    if with_loss is None:
        return ""
    try:  # the tiled loss, on a setting the plan models
        check.probe(check.build(config, args.dtype, functools.partial(planner.stepped_first, with_loss)), config)
    except ValueError as error:
        return _leave_out_tiled_loss(args, planner, f"with the tiled loss, {error}", warnings)
    return ""


def _plan(planner: Planner, progress: Progress, processes: int) -> Tuple[List[Point], Dict[str, Longest], List[str]]:
    """The table's points, each setting's longest sequence, and what to change when nothing fits."""
    request = planner.request
    found = plan_settings(planner, processes, progress.step, SEARCH_SLOTS)
    points = [planner.point(s, seq) for seq in request.seqs for s in request.settings]
    longest = {s.name: found[s] for s in request.settings}
    advice: List[str] = []
    if all(found.seq == 0 for found in longest.values()):
        best = min(request.settings, key=lambda s: planner.point(s, request.seq_step).load())
        advice = what_to_change(planner, best)
    return points, longest, advice


def _output(args, planner: Planner, points: List[Point], longest: Dict[str, Longest], advice: List[str],
            budget_from: str, warnings: List[str], attention_from: str) -> None:
    request = planner.request
    budget, backend = request.budget, request.backend
    assert budget is not None, "the CLI always plans against a budget"
    assert request.attention is not None, "the CLI names the attention it plans"
    for warning in (warnings + report.position_warnings(request.config, request.seqs, longest)
                    + report.dips(planner.modelled())):
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        limits = dict(budget_bytes=int(budget), budget_from=budget_from,
                      host_budget_bytes=None if request.host_budget is None else int(request.host_budget),
                      attention=request.attention, attention_from=attention_from,
                      attention_kernel=planner.gpu_kernel(), tensor_parallel=args.tp,
                      data_parallel=backend.world_size)
        records = ([limits] + [p.record() for p in points]
                   + [dict(setting=k, max_seq=v.seq, at_cap=v.at_cap) for k, v in longest.items()])
        json_stdout.emit(records)
    else:
        header = report.header(args.model, request.config, planner.param_sizes(), planner.layer_kinds(), args.dtype,
                               args.batch, backend, args.sp, any(planner.composable(s) for s in request.settings),
                               args.tp, verified=request.verify_full_depth)
        print("\n".join([header, *report.table(points, budget, budget_from, request.host_budget),
                         *report.longest_lines(longest, budget, request.seq_step, request.host_budget),
                         *advice, *report.notes(points, args.dtype, backend, request.optimizer_on_device,
                                                request.config, request.attention, attention_from, args.batch,
                                                args.tp, auto_shards.min_tokens_per_shard(planner.shard_device()))]))
    if args.plot:
        from ..planner.plot import plot_plan

        title = (f"{args.model}, {str(args.dtype).replace('torch.', '')}, {backend.name} x{backend.world_size}, "
                 f"batch {args.batch}")
        plot_plan(planner.modelled(), {k: v.seq for k, v in longest.items()}, budget, args.plot, title)
        print(f"plot: {args.plot}")


def run_alst(args, parser_error) -> int:
    """``tiled-mlp plan --alst``: ALST's ladder (``tiled_mlp/planner/alst.py``)."""
    with collector_paused():
        return _run_alst(args, parser_error)


def _run_alst(args, parser_error) -> int:
    budget = args.budget if args.budget is not None else alst.BUDGET
    config = load_config(alst.MODEL)
    # Points: ALST's length, then the search's (usually 3 to 4 more) for each row.
    progress = Progress(5 * len(alst.RUNGS), "plan --alst", enabled=not args.json)
    start = time.monotonic()
    try:
        climbed = alst.climb(config, alst.RUNGS, budget, on_point=progress.step, node_host=args.host_budget,
                             processes=args.workers or workers.available())
    finally:
        progress.close()
    seconds = time.monotonic() - start
    if args.json:
        json_stdout.emit([dict(model=alst.MODEL, budget_bytes=int(budget), seconds=round(seconds, 1),
                               node_host_bytes=None if args.host_budget is None else int(args.host_budget))]
                         + alst.records(climbed))
        return 0
    print("\n".join([*alst.table(config, climbed, budget, alst.MODEL, args.host_budget), "",
                     *alst.findings(config, climbed, budget),
                     f"(modelled in {seconds:.0f} s: {sum(1 for _ in climbed)} rows, each searched on its grid: "
                     + ", ".join(f"{c.rung.grid}" for c in climbed) + " tokens)"]))
    return 0
