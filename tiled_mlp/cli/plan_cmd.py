"""``tiled-mlp plan``: how many shards, the predicted peak, and whether tiling helps at all.

Predictions come from the fake-tensor memory model (exact live-storage accounting of the real code),
so nothing is allocated and the seed's sizes plan in seconds on any machine.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from tiled_mlp.core.auto_shards import MLPSize, auto_decision, fixed_bytes

from ..bench.model_memory import modeled_peak_bytes
from . import json_stdout, parsing, plan_model

GiB = 2**30


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="peak memory of one MLP step (--hidden ...) or a whole model's (--model ...)",
                              description=__doc__ + "\n" + (plan_model.__doc__ or ""))
    p.add_argument("--hidden", type=parsing.positive_int, default=None, help="one MLP: its hidden size")
    p.add_argument("--intermediate", type=parsing.positive_int, default=None, help="one MLP: its intermediate size")
    p.add_argument("--seq", type=parsing.seq_list, default=None,
                   help="tokens per sequence (--model: comma-separated lengths, default 8192,32768,65536,131072)")
    p.add_argument("--batch", type=parsing.positive_int, default=1)
    p.add_argument("--dtype", type=parsing.dtype, default=torch.bfloat16)
    p.add_argument("--budget", type=parsing.byte_size, default=None,
                   help="memory budget: " + parsing.BYTE_SIZE_FORMS + " (accelerate's max_memory forms; a bare number "
                        "is GiB). One MLP: the fewest shards that fit (default: none). --model: per rank, the longest "
                        "sequence (default: the total memory of cuda:0, else 80 GiB)")
    p.add_argument("--json", action="store_true")
    plan_model.add_arguments(p)
    p.set_defaults(run=run)


def swiglu_size(hidden: int, intermediate: int, dtype: torch.dtype) -> MLPSize:
    element = torch.empty((), dtype=dtype).element_size()
    return MLPSize(hidden, intermediate, 3 * hidden * intermediate * element, element)


def floor_bytes(hidden: int, intermediate: int, tokens: int, dtype: torch.dtype) -> int:
    return fixed_bytes(swiglu_size(hidden, intermediate, dtype), tokens)


def make_plan(hidden: int, intermediate: int, seq: int, dtype: torch.dtype, batch: int = 1, budget=None) -> dict:
    tokens = seq * batch
    model = lambda impl, n: modeled_peak_bytes(impl, hidden, intermediate, seq, dtype, n, batch)  # noqa: E731
    untiled = model("untiled", 1)
    decision = auto_decision(tokens, swiglu_size(hidden, intermediate, dtype))
    auto = decision.num_shards
    plan: Dict[str, Any] = dict(hidden=hidden, intermediate=intermediate, seq=seq, batch=batch, dtype=str(dtype).replace("torch.", ""),
                untiled_peak_bytes=untiled, auto_num_shards=auto or 1, auto_runs_untiled=auto is None, auto_reason=decision.reason,
                auto_peak_bytes=untiled if auto is None else model("fast", auto),
                floor_bytes=floor_bytes(hidden, intermediate, tokens, dtype))
    plan["tiling_helps"] = plan["auto_peak_bytes"] < untiled
    if budget is not None:
        plan["budget_bytes"] = budget
        plan.update(_fit_budget(budget, untiled, tokens, plan["floor_bytes"], lambda n: model("fast", n)))
    return plan


def _fit_budget(budget, untiled, tokens, floor, peak_at) -> dict:
    if untiled <= budget:
        return dict(budget_num_shards=None, budget_peak_bytes=untiled, budget_note="fits untiled: no tiling needed")
    if floor > budget:
        raise ValueError(
            f"a budget of {budget / GiB:.2f} GiB is too small even with one token per shard: weights, their "
            f"grads, input, output and their grads alone need {floor / GiB:.2f} GiB. Raise the budget, shorten "
            "the sequence, or shard the weights (FSDP2 / ZeRO-3)."
        )
    shards = 1
    while True:
        peak = peak_at(shards)
        if peak <= budget:
            return dict(budget_num_shards=shards, budget_peak_bytes=peak, budget_note="fewest shards (power of two) that fit")
        if shards >= tokens:
            raise ValueError(
                f"a budget of {budget / GiB:.2f} GiB does not fit even at one token per shard "
                f"(predicted {peak / GiB:.2f} GiB); raise the budget"
            )
        shards = min(tokens, shards * 2)


def run(args, parser_error) -> int:
    with json_stdout.only_json(args.json):
        return _run(args, parser_error)


def _run(args, parser_error) -> int:
    if args.alst:
        return plan_model.run_alst(args, parser_error)
    if args.model is not None:
        return plan_model.run(args, parser_error)
    if args.hidden is None or args.intermediate is None or args.seq is None:
        parser_error("give --model CONFIG (a whole model), or --hidden, --intermediate and --seq (one MLP)")
    if len(args.seq) != 1:
        parser_error(f"one MLP is planned at one --seq, got {len(args.seq)} lengths (several need --model)")
    args.seq = args.seq[0]
    try:
        plan = make_plan(args.hidden, args.intermediate, args.seq, args.dtype, args.batch, args.budget)
    except ValueError as error:
        parser_error(str(error))
    if args.json:
        json_stdout.emit(plan)
        return 0
    g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    print(f"SwiGLU hidden={args.hidden} intermediate={args.intermediate} seq={args.seq} batch={args.batch} {plan['dtype']}")
    print(f"  untiled peak:        {g(plan['untiled_peak_bytes'])}")
    if plan["auto_runs_untiled"]:
        print(f"  auto:                runs {plan['auto_reason']}")
    else:
        ratio = plan["auto_peak_bytes"] / plan["untiled_peak_bytes"]
        print(f"  auto:                {plan['auto_num_shards']} shards, peak {g(plan['auto_peak_bytes'])} ({ratio:.3f} of untiled)")
    print(f"  floor (any shards):  {g(plan['floor_bytes'])}")
    if args.budget is not None:
        if plan["budget_num_shards"] is None:
            print(f"  budget {g(args.budget)}: {plan['budget_note']}")
        else:
            print(f"  budget {g(args.budget)}: {plan['budget_num_shards']} shards, peak {g(plan['budget_peak_bytes'])}")
    return 0
