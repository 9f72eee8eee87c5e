"""What to change when no setting fits the budget at the shortest length: each knob with what the
rank would hold after it, computed from the same modelled step, not guessed.

Sharding over more ranks re-reads the step's timeline with the weights and gradients divided (the
peak can move to another moment of the step as they shrink), so the world size named is the
smallest power of two that fits by the plan's own model.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from .plan import IN_FLIGHT, LOGITS_KNOB, OFFLOADED, OPTIMIZER, Planner, Point
from .step import Setting
from .timeline import ACTIVATIONS, GRADS, LOGITS, WEIGHTS

GiB = 2**30
MAX_WORLD_SIZE = 4096


def _gib(value: float) -> str:
    return f"{value / GiB:.2f} GiB"


def what_to_change(planner: Planner, setting: Setting) -> List[str]:
    """Knobs that would let ``setting`` fit at the shortest length, as lines to print."""
    req = planner.request
    budget = req.budget
    assert budget is not None, "advice is for a budget that nothing fits"
    seq = req.seq_step
    point = planner.point(setting, seq)
    if point.device_fits and not point.host_fits:
        return _host_over(point)
    lines = [f"nothing fits {_gib(budget)} per rank: at {seq} tokens, {setting.name} holds {_gib(point.held_bytes)} ("
             + ", ".join(f"{kind} {_gib(v)}" for kind, v in point.held_parts.items() if v >= 0.005 * GiB)
             + ")."]
    if point.optimizer_on_device:
        after = point.held_bytes - point.optimizer_bytes
        lines.append(f"- --offload-optimizer: the optimizer state ({_gib(point.optimizer_bytes)}) to the host: "
                     f"{_gib(after)}" + (" (fits)" if after <= budget else " (still over)"))
    lines.append(_more_ranks(planner, setting, point))
    dominant = point.dominant
    lines.append(f"- the dominant term, {dominant} ({point.held_parts[dominant] / point.held_bytes:.0%}): "
                 + _knob(dominant, planner))
    return lines


def _host_over(point: Point) -> List[str]:
    """The device holds the step, the host does not: the knobs that move memory back, or give more."""
    assert point.host_budget is not None
    parts = ", ".join(f"{kind} {_gib(v)}" for kind, v in point.host_parts.items() if v >= 0.005 * GiB)
    lines = [f"nothing fits {_gib(point.host_budget)} of host memory per rank (--host-budget): at {point.seq} tokens "
             f"{point.setting} fits the device ({_gib(point.held_bytes)}) and holds {_gib(point.host_bytes)} on the "
             "host" + (f" ({parts})" if parts else "") + ".",
             f"- a larger --host-budget: at least {_gib(point.host_bytes)} per rank"]
    if OFFLOADED in point.host_parts:
        lines.append(f"- the settings without '+offload': the checkpointed inputs ({_gib(point.host_parts[OFFLOADED])}) "
                     "stay on the device")
    if OPTIMIZER in point.host_parts:
        after = point.held_bytes + point.host_parts[OPTIMIZER]
        lines.append(f"- the optimizer state on the device (no --offload-optimizer/--offload-params): "
                     f"{_gib(after)} on the device" + (" (fits)" if point.budget and after <= point.budget
                                                       else " (over the device budget)"))
    return lines


def _more_ranks(planner: Planner, setting: Setting, point: Point) -> str:
    req = planner.request
    name = req.backend.name if req.backend.shards_weights else "fsdp2"
    timeline = planner.timeline(setting, point.seq)
    world = max(2, req.backend.world_size * 2 if req.backend.shards_weights else 2)
    while world <= MAX_WORLD_SIZE:
        sharded = planner.point_of(setting, point.seq, timeline, replace(req.backend, name=name, world_size=world))
        sharded = replace(sharded, budget=req.budget)
        if sharded.fits:
            return (f"- more ranks: --world-size {world} --backend {name} divides the weights, gradients and "
                    f"optimizer state: {_gib(sharded.held_bytes)} per rank (the fewest ranks, in powers of two, "
                    "that fit)")
        world *= 2
    return (f"- more ranks: even {MAX_WORLD_SIZE} ranks of {name} do not fit; what sharding does not divide "
            "(activations, logits, the backend's buffers) is over the budget alone")


def _knob(kind: str, planner: Planner) -> str:
    settings = planner.request.settings
    if kind in (WEIGHTS, GRADS):
        return "shard them over more ranks (above)"
    if kind == OPTIMIZER:
        return "offload it (above), or shard it over more ranks"
    if kind == LOGITS:
        return LOGITS_KNOB + ("" if any(s.tiled_loss for s in settings) else "; try --tiled-loss auto")
    if kind == ACTIVATIONS:
        missing = [flag for flag, on in (("--checkpointing layer", any(s.checkpointing for s in settings)),
                                         ("--tiled auto", any(s.tiled for s in settings)),
                                         ("--offload-checkpoints", any(s.offload_checkpoints for s in settings)),
                                         ("--sp N (Ulysses: each of N ranks runs seq / N tokens)",
                                          any(s.sp > 1 for s in settings))) if not on]
        return ("try " + " and ".join(missing)) if missing else "more sequence parallelism (a larger --sp)"
    if kind == IN_FLIGHT:
        return "the backend's unsharded buffers: a backend that gathers less at once (zero3 per module)"
    return "no knob known"
