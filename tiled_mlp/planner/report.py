"""The plan as text: the model, the table of what each rank holds, the longest sequences, and what is
analytic rather than modelled."""
from __future__ import annotations

from itertools import pairwise
from typing import Any, Dict, List, Optional

import torch

from . import attention
from .backends import Backend, ParamSizes
from .plan import IN_FLIGHT, LOGITS_KNOB, OFFLOADED, Point
from .search import Longest
from .timeline import LOGITS

GiB = 2**30


def header(name: str, config, sizes: ParamSizes, kinds: str, dtype: torch.dtype, batch: int, backend: Backend,
           sp: int = 1, composed: bool = False, tp: int = 1, verified: bool = True) -> str:
    text = config.get_text_config()
    layers = f"{text.num_hidden_layers} layers" + (f" ({kinds})" if kinds else "")
    where = f"{backend.name} x{backend.world_size}" + (" (parameters offloaded to the host)" if backend.offload_params
                                                       else "")
    return (f"{name}: {sizes.total / 1e9:.2f}B parameters, {layers}, vocabulary {text.vocab_size}; "
            f"{str(dtype).replace('torch.', '')}, batch {batch} per rank, {where}"
            + (f", Ulysses SP over {sp} ranks (each runs seq / {sp} tokens)" if sp > 1 else "")
            + (f", tensor parallelism over {tp} ranks (DTensor, torchtitan's Llama plan: each holds 1/{tp} of the "
               f"attention, MLP and LM-head weights; parameters above are per rank)" if tp > 1 else "")
            + ("; every layer modelled (meta device: the alike layers' step put together from its 2- and 3-layer "
               "steps, event for event" + ("; each longest length modelled again at full depth)" if verified
                                           else ", exact as tests/planner/test_planner_compose.py proves; "
                                                "--verify-full-depth models each answer again with every layer)")
               if composed
               else "; every layer modelled (full depth, meta device)"))


SETTING_LEGEND = ("settings: 'tiled' tiles the MLPs, 'tiled-loss' computes the LM head and cross-entropy a token shard "
                  "at a time (never the [tokens, vocab] logits), 'norms' tiles the RMSNorms too, 'ckpt' checkpoints "
                  "every decoder layer, 'offload' keeps each checkpointed layer's input (but the last's) in host "
                  "memory, 'spN' is Ulysses sequence parallelism over N ranks (DeepSpeed's UlyssesSPAttentionHF), 'tpN' "
                  "tensor parallelism over N ranks (DTensor's parallelize_module)")
HOST_LEGEND = ("'host' is the rank's host memory at its most: the optimizer state when offloaded, ZeRO-3's gradient "
               "(and, with --offload-params, parameter) partitions there, and the offloaded checkpoints")


def _host_budget_text(host_budget: Optional[float]) -> str:
    return ("not held against a budget (--host-budget)" if host_budget is None
            else f"held against {host_budget / GiB:.2f} GiB a rank (--host-budget): 'no (host)' where only it is over")


def table(points: List[Point], budget: float, budget_from: str, host_budget: Optional[float] = None) -> List[str]:
    lines = [f"per rank, GiB; budget {budget / GiB:.2f} GiB ({budget_from}). 'held' is what 'fits' judges: the "
             "step's peak (weights, gradients, activations, backend buffers) plus the optimizer state on the device; "
             + HOST_LEGEND + ", " + _host_budget_text(host_budget),
             SETTING_LEGEND,
             "| seq | setting | step peak | optimizer | held | fits | host | dominant term of held |",
             "|---|---|---|---|---|---|---|---|"]
    for p in points:
        fits = "-" if p.fits is None else ("yes" if p.fits else "no" if not p.device_fits else "no (host)")
        optimizer = f"{p.optimizer_bytes / GiB:.2f}" + ("" if p.optimizer_on_device else " (host)")
        share = p.held_parts[p.dominant] / p.held_bytes
        lines.append(f"| {p.seq} | {p.setting} | {p.peak_bytes / GiB:.2f} | {optimizer} | {p.held_bytes / GiB:.2f} | "
                     f"{fits} | {p.host_bytes / GiB:.2f} | {p.dominant} ({share:.0%}) |")
    return lines


def longest_lines(longest: Dict[str, Longest], budget: float, step: int = 1024,
                  host_budget: Optional[float] = None) -> List[str]:
    host = "" if host_budget is None else f" and {host_budget / GiB:.2f} GiB of host memory"
    lines = [f"longest sequence held within {budget / GiB:.2f} GiB{host} per rank (multiples of {step}; each answer "
             f"fits and {step} tokens more does not, both modelled):"]
    width = max((len(setting) for setting in longest), default=0)
    for setting, found in longest.items():
        if found.at_cap:
            lines.append(f"  {setting:{width}s} at least {found.seq:,} tokens (where the search stops)")
        elif found.seq:
            lines.append(f"  {setting:{width}s} {found.seq:>9,} tokens")
        else:
            lines.append(f"  {setting:{width}s} none (not even 1024 tokens)")
    return lines


def notes(points: List[Point], dtype: torch.dtype, backend: Backend, optimizer_on_device: bool, config: Any = None,
          attention_choice: Optional[str] = None, attention_from: str = "", batch: int = 1,
          tp: int = 1, shard_floor: Optional[int] = None) -> List[str]:
    """The plan's closing notes; the attention modelled among them where ``attention_choice`` is given."""
    lines = []
    if any(p.dominant == LOGITS for p in points):
        lines.append(f"note: the logits and the loss dominate where marked; the knob that removes them is {LOGITS_KNOB}.")
    lines.append("analytic, not modelled: the optimizer state (Adam, float32 moments"
                 + ("" if dtype == torch.float32 else " and master weights")
                 + ("" if optimizer_on_device else ", on the host") + ")"
                 + ("" if backend.name == "single" else f", and {backend.name}'s division of weights and gradients and "
                    f"its '{IN_FLIGHT}' buffers (tiled_mlp/planner/backends.py)")
                 + (", the parameter partitions on the host (offload_param)" if backend.offload_params else "") + ".")
    if attention_choice is not None:
        sequence_parallel = any(p.tokens_per_rank and p.tokens_per_rank != p.seq for p in points)
        what = (f"{attention_choice} inside DeepSpeed's UlyssesSPAttentionHF, which passes it no mask: a fused causal "
                "kernel over the whole sequence on every layer" if sequence_parallel
                else attention.describe(config, attention_choice))
        lines.append(f"modelled attention ({attention_from}): {what}.")
        longest = max(points, key=lambda p: p.seq, default=None)
        if longest is not None:
            sp = longest.seq // (longest.tokens_per_rank or longest.seq)
            note = attention.workspace_note(config, attention_choice, longest.seq, sp, batch, dtype, tp)
            lines += [note] if note else []
    if shard_floor is not None:
        lines.append(f"shards: num_shards='auto' as on a Hopper-class GPU, at least {shard_floor:,} tokens a shard "
                     "(docs/auto-policy.md), the count a training step on that GPU cuts.")
    lines.append("counted in 'host': the CPU generator states the generic tiled path saves per shard (5,056 B "
                 "each, alive until the step's graph is freed); not counted: library kernels' workspaces (cuBLAS, "
                 "CPU matmul).")
    offloaded = [p for p in points if OFFLOADED in p.host_parts]
    if offloaded:
        lines.append("modelled, not analytic: the offloaded checkpoints in 'host' (the real CheckpointOffload runs in the "
                     "step); pinned host memory and the host's own fragmentation are not counted.")
    if any(p.tokens_per_rank and p.tokens_per_rank != p.seq for p in points):
        lines.append("sequence parallelism: one rank's step of seq / N tokens is modelled, with DeepSpeed's "
                     "UlyssesSPAttentionHF in it (its exchanges and copies); not in it: the tiled loss's cross-rank "
                     "sum under apply_sequence_parallel (a few scalars) and the collectives' own buffers inside NCCL.")
    return lines


def _rope_scaling(text) -> Dict[str, Any]:
    """The config's RoPE scaling ({} when none): ``rope_parameters`` (transformers >= 4.56) or ``rope_scaling``."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(text, name, None)
        if isinstance(value, dict) and (value.get("rope_type") or value.get("type")) not in (None, "default"):
            return value
    return {}


def position_warnings(config, seqs: List[int], longest: Dict[str, Longest]) -> List[str]:
    """Lengths past what the model's positions cover: ``max_position_embeddings``, or with YaRN its factor
    times the original length where that is more. The memory is modelled, the model was not trained there."""
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return []
    scaling = _rope_scaling(text)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or limit
        limit = max(limit, int(scaling.get("factor", 1.0) * original))
    past = sorted({seq for seq in seqs if seq > limit} | {f.seq for f in longest.values() if f.seq > limit})
    if not past:
        return []
    lengths = ", ".join(f"{seq:,}" for seq in past)
    if kind == "yarn":
        return [f"{lengths} tokens: past the {limit:,} the config's YaRN scaling covers (factor {scaling.get('factor')} "
                f"over {original:,}); the memory is modelled all the same, but training there needs a larger factor"]
    if kind:
        return [f"{lengths} tokens: past the model's max_position_embeddings ({limit:,}), with its {kind} RoPE "
                "scaling; the memory is modelled all the same, but the model was not trained there"]
    return [f"{lengths} tokens: past the model's max_position_embeddings ({limit:,}); "
            "the memory is modelled all the same, but the model needs position scaling (RoPE scaling such as YaRN) "
            "to train there"]


def dips(points: List[Point]) -> List[str]:
    """Where a setting holds less at a longer length than at a shorter one. Tiled with ``auto``, this is
    the policy's pass-through: where tiling one MLP saves little of that MLP's memory, auto runs it
    untiled, and without checkpointing every layer then keeps its intermediates."""
    lines = []
    for setting in dict.fromkeys(p.setting for p in points):
        mine = sorted((p for p in points if p.setting == setting), key=lambda p: p.seq)
        for shorter, longer in pairwise(mine):
            if longer.held_bytes < shorter.held_bytes:
                # 'tiled' among the name's parts: the MLPs are tiled ('tiled-loss' alone tiles only the loss).
                why = (" (auto runs an MLP untiled where tiling saves little of that MLP's memory, and every layer then "
                       "keeps its intermediates; a fixed --tiled N does not)" if "tiled" in setting.split("+") else "")
                lines.append(f"{setting} holds less at {longer.seq} tokens ({longer.held_bytes / GiB:.2f} GiB) than at "
                             f"{shorter.seq} ({shorter.held_bytes / GiB:.2f} GiB){why}; the longest length found "
                             "assumes the total grows with the length")
    return lines
