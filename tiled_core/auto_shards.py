"""The "auto" shard policy, derived from the fake-tensor memory model; its rules, and the measurements behind
each, are in docs/auto-policy.md."""
from __future__ import annotations

import contextlib
import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from .validation import INPUT_PROJECTIONS

SHARD_INTERMEDIATE_BYTES = 32 * 2**20
WORKING_SET_SHARE = 1 / 8
WORKING_SET_BUFFERS = 4
MIN_TOKENS_PER_SHARD = 1024
MIN_INTERMEDIATE_SHARE = 0.1
MIN_SAVED_BYTES = 64 * 2**20
# What untiled autograd keeps of a gated MLP (the fast path's only kind): gate(x), up(x), the activation's
# output and the product. The modelled untiled peak sits 5.1-5.6 such buffers above the fixed bytes once
# activations dominate, so four keeps the estimate low.
FAST_SAVED_INTERMEDIATES = 4
# The fewest an MLP with an activation between its projections keeps: a lower bound, so the generic path never
# tiles where it cannot pay (with one, a SwiGLU at 4096 tokens would run untiled, where 4 shards take 0.59x).
GENERIC_SAVED_INTERMEDIATES = 2

MiB = 2**20


@dataclass(frozen=True, slots=True)
class DeviceClass:
    """A device's type and, for CUDA, its compute capability (None: unknown, as for faked CUDA tensors)."""

    type: str  # "cpu", "cuda", "rocm" (torch's "cuda" device on a ROCm build), "npu", "xpu", ...
    capability: Optional[Tuple[int, int]] = None


CPU = DeviceClass("cpu")
# The floor on tokens a shard by device, beside the CPU's (docs/auto-policy.md#by-device).
MIN_TOKENS_PER_SHARD_BY_DEVICE = (("hopper", 3584), ("accelerator", 2048))
# The MLP the floors were measured on (hidden, intermediate): compiled on CUDA, a call with less matmul work
# than one floor shard of it is launch-bound when cut.
FLOOR_MEASURED_AT = (4096, 12288)
# The device a call on the meta device (the planner's steps, no real device) is decided for.
MODELLED_DEVICE = CPU

_CLASSES: Dict[torch.device, DeviceClass] = {}


def device_class(device: Optional[torch.device]) -> DeviceClass:
    """The policy's class of ``device``; the meta device, and None, stand for ``MODELLED_DEVICE``."""
    if device is None or device.type == "meta":
        return MODELLED_DEVICE
    known = _CLASSES.get(device)
    if known is None:
        known = _CLASSES[device] = _read_class(device)
    return known


def _read_class(device: torch.device) -> DeviceClass:
    if device.type != "cuda":
        return DeviceClass(device.type)
    if torch.version.hip is not None:  # AMD's GPUs answer as "cuda", with capabilities of their own
        return DeviceClass("rocm")
    if not torch.cuda.is_available():  # fake CUDA tensors on a machine without a GPU
        return DeviceClass("cuda")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceClass("cuda", tuple(torch.cuda.get_device_capability(index)))  # type: ignore[arg-type]


def min_tokens_per_shard(device: DeviceClass) -> int:
    if device.type == "cpu":
        return MIN_TOKENS_PER_SHARD
    floors = dict(MIN_TOKENS_PER_SHARD_BY_DEVICE)
    hopper = device.type == "cuda" and device.capability is not None and device.capability >= (9, 0)
    return floors["hopper" if hopper else "accelerator"]


def launch_bound(num_tokens: int, size: MLPSize, device: DeviceClass) -> bool:
    """Whether a compiled call has less matmul work than one floor shard of the MLP the floor was measured on."""
    assert size.intermediate is not None, "the work is counted from the intermediate size"
    hidden, intermediate = FLOOR_MEASURED_AT
    floor_work = min_tokens_per_shard(device) * hidden * intermediate
    return device.type == "cuda" and num_tokens * size.hidden * size.intermediate < floor_work


@contextlib.contextmanager
def modelled_as(device: DeviceClass) -> Iterator[None]:
    global MODELLED_DEVICE
    before, MODELLED_DEVICE = MODELLED_DEVICE, device
    try:
        yield
    finally:
        MODELLED_DEVICE = before


@dataclass(frozen=True, slots=True)
class MLPSize:
    hidden: int
    intermediate: Optional[int]  # None: unknown (the policy falls back to ~hidden tokens per shard)
    weight_bytes: int
    element_bytes: int
    # The generic path's extra working set: its recompute returns a shard's parameter gradients beside the
    # running sums. None: the fast path, whose buffers the shard-size rule already counts.
    generic_trainable_bytes: Optional[int] = None


def intermediate_size(module: nn.Module) -> Optional[int]:
    fused_features = getattr(getattr(module, "gate_up_proj", None), "out_features", None)
    if isinstance(fused_features, int):
        return fused_features // 2
    for name in INPUT_PROJECTIONS:
        projection = getattr(module, name, None)
        out_features = getattr(projection, "out_features", None)
        if isinstance(out_features, int):
            return _local_rows(projection, out_features)
    # Any other MLP (an nn.Sequential, custom names): its first Linear-like layer's width.
    for sub in module.modules():
        if sub is not module and isinstance(getattr(sub, "in_features", None), int):
            out_features = getattr(sub, "out_features", None)
            return out_features if isinstance(out_features, int) else None
    return None


def _local_rows(projection: Any, out_features: int) -> int:
    """The rows of a (DTensor) weight the largest share of its ranks holds: not this rank's, so that every rank
    decides the same shard count (ranks running different counts of the module's collectives hang)."""
    # The registered parameter, never ``projection.weight``: a parametrized weight (spectral norm) is computed
    # by that read, and its power iteration updates buffers.
    parameters = getattr(projection, "_parameters", None) or {}
    weight = parameters.get("weight")
    placements, mesh = getattr(weight, "placements", None), getattr(weight, "device_mesh", None)
    if weight is None or placements is None or mesh is None:
        return out_features
    rows = int(weight.shape[0])
    for ranks, placement in zip(mesh.shape, placements, strict=True):
        if placement.is_shard(0):
            rows = -(-rows // ranks)  # the first ranks hold ceil(rows / ranks), as torch.chunk splits
    return rows


def fixed_bytes(size: MLPSize, num_tokens: int) -> int:
    return 2 * size.weight_bytes + 4 * num_tokens * size.hidden * size.element_bytes


@dataclass(frozen=True, slots=True)
class AutoDecision:
    num_shards: Optional[int]  # None: run the module untiled
    reason: str


def shard_count(num_tokens: int, size: MLPSize, device: DeviceClass = CPU) -> int:
    """Rule 1."""
    assert size.intermediate is not None, "the shard-size rule needs the intermediate size"
    fixed = fixed_bytes(size, num_tokens)
    buffer_bytes = min(SHARD_INTERMEDIATE_BYTES, WORKING_SET_SHARE * fixed / WORKING_SET_BUFFERS)
    tokens_per_shard = max(min_tokens_per_shard(device), int(buffer_bytes // (size.intermediate * size.element_bytes)))
    return max(1, math.ceil(num_tokens / tokens_per_shard))


def estimated_saved_bytes(num_tokens: int, size: MLPSize, num_shards: int) -> float:
    """The bytes ``num_shards`` shards stop holding, net of their own working set."""
    assert size.intermediate is not None, "the saving is estimated from the intermediate size"
    intermediate_bytes = num_tokens * size.intermediate * size.element_bytes
    if size.generic_trainable_bytes is None:
        # The fast path keeps about WORKING_SET_BUFFERS shard-sized buffers, and only while a shard runs.
        return FAST_SAVED_INTERMEDIATES * intermediate_bytes - WORKING_SET_BUFFERS * intermediate_bytes / num_shards
    # The generic recompute keeps a shard's worth of the intermediates (one shard saves nothing), beside its extra
    # buffers: the trainable bytes once more, and a copy of a shard's input gradient and output.
    saved = GENERIC_SAVED_INTERMEDIATES * intermediate_bytes * (1 - 1 / num_shards)
    extra = size.generic_trainable_bytes + 2 * math.ceil(num_tokens / num_shards) * size.hidden * size.element_bytes
    return saved - extra


def auto_decision(num_tokens: int, size: MLPSize, device: DeviceClass = CPU, compiling: bool = False) -> AutoDecision:
    """The shard count for ``num_tokens`` tokens on ``device`` (None: run the module untiled), and why."""
    if size.intermediate is None:
        if num_tokens <= size.hidden:  # one shard would be the whole call: the machinery for nothing
            return AutoDecision(None, f"untiled: {num_tokens} tokens, no more than the hidden size ({size.hidden}), "
                                      "and the intermediate size is unknown (~hidden tokens a shard)")
        num_shards = math.ceil(num_tokens / max(1, size.hidden))
        return AutoDecision(num_shards, f"tiled ({_shards(num_shards)} of ~{math.ceil(num_tokens / num_shards)} "
                                        "tokens): the intermediate size is unknown, so ~hidden tokens a shard")
    intermediate_bytes = num_tokens * size.intermediate * size.element_bytes
    fixed = fixed_bytes(size, num_tokens)
    if intermediate_bytes < MIN_INTERMEDIATE_SHARE * fixed:
        return AutoDecision(None, f"untiled: a [tokens, intermediate] buffer ({_size(intermediate_bytes)}) is "
                                  f"under {MIN_INTERMEDIATE_SHARE:.0%} of the {_size(fixed)} no tiling removes")
    if compiling and launch_bound(num_tokens, size, device):
        return AutoDecision(None, f"untiled: compiled on {device.type}, the call is less matmul work than one "
                                  f"{min_tokens_per_shard(device)}-token shard of a {FLOOR_MEASURED_AT[0]} x "
                                  f"{FLOOR_MEASURED_AT[1]} MLP, so its shards would be launch-bound")
    num_shards = shard_count(num_tokens, size, device)
    saved = estimated_saved_bytes(num_tokens, size, num_shards)
    shards = ("generic path, " if size.generic_trainable_bytes is not None else "") + _shards(num_shards)
    if saved <= 0:
        return AutoDecision(None, f"untiled: tiling ({shards}) would free no more than its own buffers take")
    if saved < MIN_SAVED_BYTES:
        return AutoDecision(None, f"untiled: tiling ({shards}) would save {_size(saved)}, "
                                  f"under the {MIN_SAVED_BYTES / MiB:.0f} MiB floor")
    return AutoDecision(num_shards, f"tiled ({shards} of ~{math.ceil(num_tokens / num_shards)} tokens): "
                                    f"saves ~{_size(saved)}")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"


def _shards(num_shards: int) -> str:
    return f"{num_shards} shard{'s' if num_shards != 1 else ''}"


# Everything module-level the policy's answer rests on besides the call's sizes: its constants (tests and
# ``integration_tests/zero_training.py`` set ``MIN_SAVED_BYTES``) and its functions (a patched rule).
# ``tests/test_decision_memory.py`` checks that every constant is here.
POLICY_NAMES = ("SHARD_INTERMEDIATE_BYTES", "WORKING_SET_SHARE", "WORKING_SET_BUFFERS", "MIN_TOKENS_PER_SHARD",
                "MIN_INTERMEDIATE_SHARE", "MIN_SAVED_BYTES", "FAST_SAVED_INTERMEDIATES", "GENERIC_SAVED_INTERMEDIATES",
                "MiB", "MIN_TOKENS_PER_SHARD_BY_DEVICE", "FLOOR_MEASURED_AT", "MODELLED_DEVICE", "auto_decision",
                "fixed_bytes", "shard_count", "estimated_saved_bytes", "min_tokens_per_shard", "launch_bound", "_size",
                "_shards")
# ``policy_inputs(module)``: their values now, read in C (the call path reads them at every auto call).
policy_inputs = operator.attrgetter(*POLICY_NAMES)


# Answers by sizes, for one ``policy_inputs()``: a short call that passes through asks the same question
# at every step, and forming the answer's sentence costs more than the rest of the pass-through decision.
_REMEMBERED: Dict[tuple, AutoDecision] = {}
_REMEMBERED_FOR: list = [None]  # the ``policy_inputs()`` the answers were given under
_REMEMBERED_LIMIT = 512  # distinct sizes kept; varying sequence lengths start it afresh


def remembered_auto_decision(num_tokens: int, hidden: int, intermediate: Optional[int], weight_bytes: int,
                             element_bytes: int, generic_trainable_bytes: Optional[int],
                             device: Optional[DeviceClass] = None, compiling: bool = False) -> AutoDecision:
    """``auto_decision`` on these sizes, answered from memory when asked before under the same ``policy_inputs()``."""
    device = MODELLED_DEVICE if device is None else device
    inputs = policy_inputs(sys.modules[__name__])
    if inputs != _REMEMBERED_FOR[0]:  # a constant or a rule set since: every answer may differ
        _REMEMBERED.clear()
        _REMEMBERED_FOR[0] = inputs
    key = (num_tokens, hidden, intermediate, weight_bytes, element_bytes, generic_trainable_bytes, device, compiling)
    decision = _REMEMBERED.get(key)
    if decision is None:
        if len(_REMEMBERED) >= _REMEMBERED_LIMIT:
            _REMEMBERED.clear()
        decision = _REMEMBERED[key] = auto_decision(
            num_tokens, MLPSize(hidden, intermediate, weight_bytes, element_bytes, generic_trainable_bytes), device,
            compiling)
    return decision


def auto_num_shards(num_tokens: int, size: MLPSize, device: DeviceClass = CPU) -> Optional[int]:
    return auto_decision(num_tokens, size, device).num_shards
