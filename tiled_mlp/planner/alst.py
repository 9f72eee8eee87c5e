"""ALST's ladder, modelled: each row of the feature ablation of Arctic Long Sequence Training (Bekman et
al., 2025, arXiv 2506.13996: Llama-8B, one node of 8 x H100 80 GB, DeepSpeed ZeRO-3 with the optimizer
on the host and every layer checkpointed) and its one-GPU run (everything, and the parameters on the host
too), each with the longest sequence this planner finds at 80 GiB a rank, side by side with the length
ALST measured. Two rows after ALST's are not ALST's: its last two with this library's tiled RMSNorm
(``Setting.tiled_norms``) in place of Hugging Face's float32 one, the term where ours falls short (ALST
ran Liger-Kernel's fused RMSNorm, which keeps no float32 [tokens, hidden] tensor either).

A node's host memory (``node_host``, optional) is shared by the row's ranks (an eighth each on eight,
all of it on one GPU), and a row's longest length then fits the host too: checkpoint offload moves the
layer inputs there, and with the norms tiled the host is what runs out first on a node of 2 TB.

ALST's figures are its rounded ones (K = 1000, M = 10^6). Ours are searched on a grid of tokens (one
number per row, ``Rung.grid``: a fitting length and one grid step more not fitting, both modelled);
under SP=8 the grid is 8192 tokens (1024 per rank). Every row also models ALST's own length (rounded
up to the grid): where ours is shorter, what the rank holds there and which allocations make its peak
(``Planner.peak_allocations``); where ours is longer, the room our model leaves at ALST's length, which
is what ALST lost to what the model does not count (the allocator's fragmentation, the CUDA context,
NCCL's buffers), and the host memory a node needs at our length. ALST's length is modelled first: it
guides the search (``search.py`` draws its line through it), so it costs one step, not two.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

from . import attention, sequence_parallel
from .backends import Backend
from .plan import OFFLOADED, Planner, Point, Request
from .search import Longest
from .step import Setting
from .workers import run_tasks

GiB = 2**30
BUDGET = 80 * GiB
MODEL = "llama-3.1-8b"
NODE_RANKS = 8


@dataclass(frozen=True)
class Rung:
    label: str  # ALST's row, in its words
    alst: str  # ALST's measured longest sequence, as printed
    alst_tokens: int
    setting: Setting
    world_size: int = NODE_RANKS
    offload_params: bool = False
    grid: int = 1024


_EVERYTHING = dict(tiled_loss=True, offload_checkpoints=True)
RUNGS = [
    Rung("baseline", "32K", 32_000, Setting(tiled=False, checkpointing=True)),
    Rung("+ tiled loss", "160K", 160_000, Setting(tiled=False, checkpointing=True, tiled_loss=True)),
    Rung("+ Ulysses SP=8", "1.1M", 1_100_000, Setting(tiled=False, checkpointing=True, tiled_loss=True, sp=8),
         grid=8192),
    Rung("+ tiled MLP", "1.2M", 1_200_000, Setting(tiled=True, checkpointing=True, tiled_loss=True, sp=8), grid=8192),
    Rung("+ checkpoint offload, without tiled MLP", "2.4M", 2_400_000,
         Setting(tiled=False, checkpointing=True, sp=8, **_EVERYTHING), grid=8192),
    Rung("everything (8 ranks)", "3.7M", 3_700_000, Setting(tiled=True, checkpointing=True, sp=8, **_EVERYTHING),
         grid=8192),
    Rung("1 GPU: everything + parameter offload", "500K", 500_000,
         Setting(tiled=True, checkpointing=True, **_EVERYTHING), world_size=1, offload_params=True),
    # Not ALST's rows: its last two with this library's tiled RMSNorm (``apply_tiled_mlp(norms=True)``) in
    # place of Hugging Face's float32 one, the term where ours falls short; ALST ran Liger's fused RMSNorm.
    Rung("everything + tiled RMSNorm (this library; ALST used Liger's fused RMSNorm)", "3.7M", 3_700_000,
         Setting(tiled=True, checkpointing=True, sp=8, tiled_norms=True, **_EVERYTHING), grid=8192),
    Rung("1 GPU: everything + parameter offload + tiled RMSNorm (this library; ALST used Liger's fused RMSNorm)",
         "500K", 500_000, Setting(tiled=True, checkpointing=True, tiled_norms=True, **_EVERYTHING), world_size=1,
         offload_params=True),
]


@dataclass
class Climbed:
    """One rung: our longest sequence and the point there; the point at ALST's length, and, where ours is
    shorter, what is live at that point's peak."""

    rung: Rung
    longest: Longest
    point: Optional[Point]  # at our longest (None: not even one grid step)
    at_alst: Point
    at_alst_peak: Optional[Dict[str, float]] = None

    @property
    def ratio(self) -> float:
        return self.longest.seq / self.rung.alst_tokens


def planner_for(config, rung: Rung, budget: float = BUDGET, node_host: Optional[float] = None) -> Planner:
    """A plan of ``rung``'s one setting, as ALST ran it: ZeRO-3, the optimizer on the host, bfloat16,
    FlashAttention-2 with its GPU workspace (``attention_workspace.py``); each rank with its share of
    ``node_host`` where one is given."""
    # The search's cap: two and a half times ALST's length, a rank's share of it.
    cap_per_rank = math.ceil(2.5 * rung.alst_tokens / rung.setting.sp / rung.grid) * rung.grid
    request = Request(config, [], [rung.setting], Backend("zero3", rung.world_size, offload_params=rung.offload_params),
                      dtype=torch.bfloat16, budget=budget, optimizer_on_device=False, seq_step=rung.grid,
                      seq_cap=cap_per_rank, host_budget=None if node_host is None else node_host / rung.world_size,
                      verify_full_depth=False, attention=attention.FLASH, gpu=True)
    return Planner(request)


def alst_seq(planner: Planner, rung: Rung) -> int:
    """ALST's length, rounded up to the row's grid."""
    step = planner.seq_step(rung.setting)
    return math.ceil(rung.alst_tokens / step) * step


def climb(config, rungs: List[Rung] = RUNGS, budget: float = BUDGET,
          on_point: Callable[[str], None] = lambda label: None, node_host: Optional[float] = None,
          processes: int = 1) -> List[Climbed]:
    """Each rung's row, the rungs modelled side by side by up to ``processes`` processes (``workers.py``);
    ``on_point`` gets a label for each point modelled."""
    if any(rung.setting.sp > 1 for rung in rungs):
        sequence_parallel.load_deepspeed()
    tasks = [functools.partial(_climb_rung, config, rung, budget, node_host) for rung in rungs]
    return run_tasks(tasks, on_point, processes)


def _climb_rung(config, rung: Rung, budget: float, node_host: Optional[float],
                on_point: Callable[[str], None]) -> Climbed:
    planner = planner_for(config, rung, budget, node_host)
    planner.on_point = on_point
    # First: it guides the search. Described, for what its peak holds where it does not fit.
    at_alst, at_alst_peak = planner.point_and_peak(rung.setting, alst_seq(planner, rung))
    found = planner.longest(rung.setting)
    point = planner.point(rung.setting, found.seq) if found.seq else None
    climbed = Climbed(rung, found, point, at_alst)
    if not at_alst.device_fits:  # what the device holds at its peak there (the host's is one term)
        climbed.at_alst_peak = at_alst_peak
    return climbed


def families(config, allocations: Dict[str, float], sp: int) -> Dict[str, float]:
    """``Planner.peak_allocations`` grouped by what their last dimension and dtype say they are."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    names = {text.hidden_size: "[tokens, hidden]", text.intermediate_size: "[tokens, intermediate] (the MLP's)",
             head_dim: "[.., head_dim] (attention: q, k, v, output" + (", over the whole sequence)" if sp > 1 else ")"),
             text.vocab_size: "[tokens, vocabulary] (logits)"}
    out: Dict[str, float] = {}
    for label, nbytes in allocations.items():
        if label in ("weights", "gradients"):
            family = label
        elif attention.is_workspace(label):
            family = "the attention kernel's own workspace"
        else:
            dtype, shape = (label.split(" ", 2) + ["", ""])[1:3]
            dims = [d for d in shape.strip("[]").split(",") if d.strip().isdigit()]
            last = int(dims[-1]) if dims else 0
            family = f"{dtype} {names.get(last, f'[.., {last}]')}"
        out[family] = out.get(family, 0.0) + nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def _tokens(seq: int) -> str:
    return f"{seq / 1e6:.2f}M" if seq >= 1_000_000 else f"{seq / 1e3:.0f}K"


def table(config, climbed: List[Climbed], budget: float = BUDGET, model: str = MODEL,
          node_host: Optional[float] = None) -> List[str]:
    host_limit = ("" if node_host is None else
                  f", {node_host / GiB:,.0f} GiB of host memory a node (shared by the row's ranks)")
    lines = [f"ALST's ladder, modelled: {model}, bfloat16, batch 1, {budget / GiB:g} GiB a rank{host_limit}, DeepSpeed "
             "ZeRO-3 with the optimizer on the host, every layer checkpointed (ALST, arXiv 2506.13996; its figures "
             "rounded as printed).",
             "Per rank, GiB, at our longest: 'device' is what 'fits' judges; 'host' the rank's host memory at its most "
             "(optimizer, ZeRO-3's host partitions, offloaded checkpoints), x8 for a node of 8 ranks.",
             "| ALST's row | our setting | ranks | ALST measured | ours | ours / ALST | device | host (node) | "
             "dominant term | ours at ALST's length |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in climbed:
        rung, p, a = c.rung, c.point, c.at_alst
        ours = ("at least " if c.longest.at_cap else "") + f"{c.longest.seq:,}"
        device = _gib(p.held_bytes) if p else "-"
        host = "-" if p is None else _gib(p.host_bytes) + (f" ({_gib(p.host_bytes * rung.world_size)})"
                                                           if rung.world_size > 1 else "")
        dominant = "-" if p is None else f"{p.dominant} ({p.held_parts[p.dominant] / p.held_bytes:.0%})"
        there = f"{a.seq:,}: {_gib(a.held_bytes)}, " + _verdict(a, budget, rung.world_size)
        lines.append(f"| {rung.label} | {rung.setting.name} | {rung.world_size} | {rung.alst} | {ours} | "
                     f"{c.ratio:.2f} | {device} | {host} | {dominant} | {there} |")
    return lines


def _verdict(a: Point, budget: float, ranks: int) -> str:
    """Whether the point at ALST's length fits: the device's room or excess, and the host's excess (a node's)."""
    if not a.device_fits:
        return "over by " + _gib(a.held_bytes - budget)
    if not a.host_fits:
        assert a.host_budget is not None
        return f"fits the device, host over by {_gib((a.host_bytes - a.host_budget) * ranks)} a node"
    return "fits, room " + _gib(budget - a.held_bytes)


def _host_bound(p: Point) -> bool:
    """The host, not the device, is the fuller of the two at ``p``: what stopped the search there."""
    return p.host_budget is not None and p.budget is not None and p.host_bytes / p.host_budget > p.held_bytes / p.budget


def findings(config, climbed: List[Climbed], budget: float = BUDGET) -> List[str]:
    """Per row, what the numbers say: the term over the budget at ALST's length where ours is shorter, the
    room left there and the host a node needs where ours is longer."""
    lines = []
    for c in climbed:
        rung, p, a = c.rung, c.point, c.at_alst
        if c.at_alst_peak is not None:
            top = list(families(config, c.at_alst_peak, rung.setting.sp).items())[:3]
            lines.append(f"- {rung.label}: ours is {1 - c.ratio:.0%} short of ALST's {rung.alst}. At {a.seq:,} tokens "
                         f"the rank holds {_gib(a.held_bytes)} GiB ({a.dominant} {_gib(a.held_parts[a.dominant])}); "
                         "live at that step's peak, by dtype and last dimension: "
                         + ", ".join(f"{family} {_gib(v)}" for family, v in top) + ".")
        elif not a.host_fits:
            assert a.host_budget is not None
            lines.append(f"- {rung.label}: ours is {1 - c.ratio:.0%} short of ALST's {rung.alst}, for host memory: at "
                         f"{a.seq:,} tokens the device holds {_gib(a.held_bytes)} GiB, but a node needs "
                         f"{_gib(a.host_bytes * rung.world_size)} GiB of host memory, over its "
                         f"{_gib(a.host_budget * rung.world_size)}.")
        elif p is not None:
            node = p.host_bytes * rung.world_size
            offloaded = p.host_parts.get(OFFLOADED, 0.0)
            lines.append(f"- {rung.label}: ours is {c.ratio - 1:.0%} past ALST's {rung.alst}; at ALST's length our model "
                         f"leaves {_gib(budget - a.held_bytes)} GiB of the {budget / GiB:g} unused: what the model does "
                         "not count (the allocator's fragmentation, the CUDA context, NCCL's buffers) or a longer length "
                         "ALST did not try (its runs, below)"
                         + (f"; at ours a node of {rung.world_size} ranks holds {_gib(node)} GiB of host memory"
                            + (f" ({_gib(offloaded)} GiB a rank of offloaded checkpoints)" if offloaded else "")
                            if rung.world_size > 1 else "")
                         + (f"; ours stops where the host is full ({_gib(node)} GiB a node, the device at "
                            f"{_gib(p.held_bytes)})" if _host_bound(p) else "") + ".")
    found = [(c.point.seq, c.rung.setting.sp) for c in climbed if c.point is not None]
    if found:
        seq, sp = max(found)
        lines.append(f"- {attention.workspace_note(config, attention.FLASH, seq, sp)}")
    return lines + ["", *ALST_RUNS]


# What ALST's own run files say about these rows (ArcticTraining, projects/sequence-parallelism/
# run-h100-sp8-llama-8b*.yml and run-h100-sp1-llama-8b.yml): facts beside the model, not modelled.
ALST_RUNS = [
    "ALST's runs (ArcticTraining's configs for these rows, projects/sequence-parallelism/run-h100-*-llama-8b*.yml):",
    "- every row after the baseline ran Liger-Kernel's Llama ('model: type: liger': fused RMSNorm, SwiGLU, RoPE and "
    "linear cross-entropy). This planner models Hugging Face's own modules with this library's tiled MLP and tiled "
    "loss: Hugging Face's RMSNorm computes in float32 ([tokens, hidden] float32 copies, kept and in its backward) and "
    "its SwiGLU keeps the SiLU's output, which Liger's fused kernels do not. With Hugging Face's norms that is the term "
    "where ours is shorter. The last two rows (not ALST's) tile the RMSNorms with this library instead "
    "(apply_tiled_mlp(norms=True): a norm keeps only its input, its float32 tensors exist one shard at a time), as "
    "Liger's keep none: the device then holds 1.7 to 1.8 times ALST's lengths, so ALST's lengths (set by hand, below) "
    "were lengths that ran, not where its devices ran out; with the checkpoints offloaded, a node's host memory is "
    "what a longer run meets first (--host-budget).",
    "- the lengths are set by hand, round, in each config's max_length (32_000, 160_000, 1_100_000, '1_200_000 # ok', "
    "2_400_000, 3_800_000 for the 3.7M row, '500000 # ok'): each a length that ran, not a searched maximum.",
    "- one GPU: 555,000 tokens failed with 'Triton Error [CUDA]: an illegal memory access' (a kernel's failure, not "
    "memory), so 500K is where ALST stopped for a reason no memory model has.",
]


def records(climbed: List[Climbed]) -> List[dict]:
    return [dict(row=c.rung.label, setting=c.rung.setting.name, world_size=c.rung.world_size,
                 offload_params=c.rung.offload_params, grid=c.rung.grid, alst=c.rung.alst,
                 alst_tokens=c.rung.alst_tokens, max_seq=c.longest.seq, at_cap=c.longest.at_cap,
                 ratio=round(c.ratio, 4), at_max=c.point.record() if c.point else None, at_alst=c.at_alst.record(),
                 at_alst_peak={k: int(v) for k, v in (c.at_alst_peak or {}).items()})
            for c in climbed]
