"""The "auto" shard policy, derived from the fake-tensor memory model (docs/auto-policy.md).

Three rules, all cheap enough for every forward:

1. **Shard size**: what no tiling removes (weights and their grads, input, output and both of their
   grads: the *fixed bytes*) sets the scale. A shard's working set is about four ``[tokens,
   intermediate]`` buffers; keeping it under ``WORKING_SET_SHARE`` (1/8) of the fixed bytes puts the
   peak within ~12% of that floor. Shards are capped at ``SHARD_INTERMEDIATE_BYTES`` (32 MiB) per
   buffer: at 131072 tokens, hidden 4096, intermediate 12288, bf16 that is 97 shards of ~1365 tokens,
   0.219 of untiled, within 3% of the floor (0.213: input, output, their gradients, weights and
   theirs), where 64 MiB gave 0.225 and 193 shards 0.216 (on a GPU such
   shards cost time: rule 4's floor binds there). (Fused MoE experts see only shard x top-k / experts tokens each and take the
   hidden-size rule below, so their shards stay large.) On the CPU shards are floored at ``MIN_TOKENS_PER_SHARD`` (1024) so smaller MLPs
   are not cut into slivers that only add time: hidden 1024, intermediate 2816, 8192 tokens, CPU fp32,
   the fast path took 1.23x the untiled step with 4 shards of 2048 tokens, 1.25x with 8 of 1024 and
   1.36x with 15 of 546 (docs/auto-policy.md).
2. **Pass-through on share**: tiling costs recompute (11 matmul units against 9) and some fixed
   buffers, so it only pays when the intermediates it stops keeping are a real share of the step's
   memory. When the whole call's intermediate bytes are under ``MIN_INTERMEDIATE_SHARE`` of the fixed
   bytes, "auto" runs the module untiled: at 2048 tokens of the 4096/12288 model, tiling would save
   at most 4-9% of the peak for ~20% more time, and with one or two shards it raises the peak.
3. **Pass-through on size**: a share says nothing about scale. A tiny MLP's intermediates are a large
   share of its own few MB, yet those MB never decide whether a step fits, while the time is paid at
   every call: on this CPU (fp32, fast path, the shards rule 1 picks, 15 rounds interleaved with the
   untiled step, ``python -m tiled_mlp.bench.policy_sweep --table pass-through``) hidden 512 /
   intermediate 1408 took 1.216x the untiled step at 1024 tokens (1 shard, 9 MiB saved), 1.222x at
   2048 (2 shards, 34.5 MiB) and 1.213x at 4096 (4 shards, 96.5 MiB); hidden 1024 / intermediate 2816
   1.217x at 1024 (7 MiB) and 1.227x at 2048 (58 MiB); interquartile ranges within 0.03. The cost is
   a fixed +21-23% of the MLP's time that does not shrink with the saving, so the saving needs a
   scale of its own: the bytes the shards stop holding, net of their own buffers
   (``estimated_saved_bytes``), must reach ``MIN_SAVED_BYTES``, 64 MiB. That is 0.4% of a 16 GiB
   accelerator (the smallest one trains on) and 0.08% of an 80 GiB one, the size of what the memory
   system itself rounds and keeps aside: the CUDA caching allocator rounds every large block up to
   2 MiB and serves 1-10 MiB requests from 20 MiB segments, and cuBLAS keeps a workspace per handle.
   The estimate errs low where activations dominate (it counts four saved intermediates; the model
   shows 5.1-5.6), so wherever "auto" tiles the modelled peak drops by at least the floor, and where
   the floor alone sends a call untiled it forgoes under twice the floor (81 MiB at most over hidden
   256-4096 in fp32 and bf16, ``tests/test_auto_policy.py``). On the default bench 1024 and 2048
   tokens run untiled (0 and 22 MiB estimated, 9 and 34.5 modelled) and 4096 tiles (66; 96.5); the
   seed size tiles from 4096 tokens (4 shards, 288 MiB estimated), so 8192 and longer are unchanged.
   The saving is per call: with activation checkpointing (the setting tiling is for) one layer's
   intermediates are alive at a time; a model trained without it keeps every layer's, and there a
   pass-through forgoes the saving once per layer.
   The same estimate covers the generic path, where extra buffers (a second copy of the trainable
   parameters' gradients, a shard's input gradient and output) can outweigh what the shards save, one
   shard always: a LoRA MLP in one shard reached 1.07x untiled, a small GELU MLP 1.19x (measured with
   the exact tracker; ``tests/test_auto_policy.py`` sweeps such modules).

4. **The device** (``DeviceClass``, read once per device by ``device_class``): rule 1's token floor is
   the CPU's 1024 there, 3584 on a Hopper-class CUDA GPU and 2048 on any other accelerator; and under
   ``torch.compile`` on CUDA a call with less matmul work than one floor shard passes through
   (``launch_bound``). The numbers and their sources are at ``MIN_TOKENS_PER_SHARD_BY_DEVICE``.

``auto_decision`` returns the count with a sentence saying why; ``auto_num_shards`` only the count.
"""
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
# Rule 3 (see above): a net saving under this is noise on any accelerator, and tiling's time is not.
MIN_SAVED_BYTES = 64 * 2**20
# What untiled autograd keeps of a gated MLP (the fast path's only kind): gate(x), up(x), the
# activation's output and the product, four [tokens, intermediate] tensors. The modelled untiled peak
# sits 5.1-5.6 such buffers above the fixed bytes once activations dominate (the gradients in
# backward add to them), so estimating with four keeps the saving on the low side there.
FAST_SAVED_INTERMEDIATES = 4
# The fewest [tokens, intermediate] tensors untiled autograd keeps for an MLP with an activation
# between its projections. A lower bound, so the generic path never tiles where it cannot pay; with
# one, a SwiGLU at 4096 tokens would run untiled, where 4 shards take 0.59x the memory.
GENERIC_SAVED_INTERMEDIATES = 2

MiB = 2**20


@dataclass(frozen=True, slots=True)
class DeviceClass:
    """What the policy needs to know about a device: its type and, for CUDA, the compute capability
    (None: unknown, as for CUDA tensors faked on a machine without a GPU)."""

    type: str  # "cpu", "cuda", "rocm" (torch's "cuda" device on a ROCm build), "npu", "xpu", ...
    capability: Optional[Tuple[int, int]] = None


CPU = DeviceClass("cpu")
# Rule 1's floor on tokens a shard by device (the CPU's: MIN_TOKENS_PER_SHARD). From docs/gpu.md, one H200,
# "The MLP" table's 131072 row and the shard sweep under it (hidden 4096, intermediate 12288, bf16; memory,
# time against untiled): 97 shards (rule 1 alone) 0.218, 1.304; 64: 0.220, 1.242; 32: 0.227, 1.210; 16:
# 0.240, 1.211. ~4096 tokens reach the recompute's time floor (1.22); 3584 is the largest multiple of 512
# whose count (37) the fake-tensor model keeps within 0.23 there (4096: 0.231). Capability >= 9.0 (Hopper,
# Blackwell) takes it; any other accelerator, not measured, takes 2048 (docs/auto-policy.md#by-device).
MIN_TOKENS_PER_SHARD_BY_DEVICE = (("hopper", 3584), ("accelerator", 2048))
# The MLP the floors were measured on (hidden, intermediate): compiled on CUDA, a call with less matmul work
# than one floor shard of it is launch-bound when cut (docs/gpu.md's torch.compile table, first row).
FLOOR_MEASURED_AT = (4096, 12288)
# The device a call on the meta device (the planner's steps, no real device) is decided for.
MODELLED_DEVICE = CPU

_CLASSES: Dict[torch.device, DeviceClass] = {}


def device_class(device: Optional[torch.device]) -> DeviceClass:
    """The policy's class of ``device`` (read once per device); the meta device, and None, stand for
    ``MODELLED_DEVICE``."""
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
    """Rule 1's floor on tokens a shard on ``device`` (see ``MIN_TOKENS_PER_SHARD_BY_DEVICE``)."""
    if device.type == "cpu":
        return MIN_TOKENS_PER_SHARD
    floors = dict(MIN_TOKENS_PER_SHARD_BY_DEVICE)
    hopper = device.type == "cuda" and device.capability is not None and device.capability >= (9, 0)
    return floors["hopper" if hopper else "accelerator"]


def launch_bound(num_tokens: int, size: MLPSize, device: DeviceClass) -> bool:
    """Whether a compiled call on ``device`` has less matmul work than one floor shard of the MLP the floor
    was measured on: cut, every shard would be launch-bound (CUDA only; needs the intermediate size)."""
    assert size.intermediate is not None, "the work is counted from the intermediate size"
    hidden, intermediate = FLOOR_MEASURED_AT
    floor_work = min_tokens_per_shard(device) * hidden * intermediate
    return device.type == "cuda" and num_tokens * size.hidden * size.intermediate < floor_work


@contextlib.contextmanager
def modelled_as(device: DeviceClass) -> Iterator[None]:
    """Calls on the meta device (a modelled step) decided as on ``device`` while inside."""
    global MODELLED_DEVICE
    before, MODELLED_DEVICE = MODELLED_DEVICE, device
    try:
        yield
    finally:
        MODELLED_DEVICE = before


@dataclass(frozen=True, slots=True)
class MLPSize:
    """What the policy needs to know about a module, read without running it."""

    hidden: int
    intermediate: Optional[int]  # None: unknown (the policy falls back to ~hidden tokens per shard)
    weight_bytes: int
    element_bytes: int
    # The generic path's extra working set: its recompute returns a shard's parameter gradients beside
    # the running sums (so the trainable bytes once more) and copies a shard's input gradient and
    # output. None: the fast path, whose buffers the shard-size rule already counts.
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
    """The rows of the projection's weight the largest share of its ranks holds: under tensor parallelism (a
    DTensor weight, read through its ``placements`` and ``device_mesh``) the slice of the intermediate dimension a
    shard's activations take. The largest share, not this rank's: where the rows do not split evenly, every rank
    of the group must still decide the same shard count (the generic kernel runs the module's collectives once
    per shard, and ranks running different counts of them fail or hang)."""
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
    """What no shard count removes: weights and their grads, input, output and both of their grads."""
    return 2 * size.weight_bytes + 4 * num_tokens * size.hidden * size.element_bytes


@dataclass(frozen=True, slots=True)
class AutoDecision:
    """What "auto" chose for one call, and why in one sentence (stored as ``module.tiling.last_reason``)."""

    num_shards: Optional[int]  # None: run the module untiled
    reason: str


def shard_count(num_tokens: int, size: MLPSize, device: DeviceClass = CPU) -> int:
    """Rule 1: shards whose ``[tokens, intermediate]`` buffer stays near the floor's scale, of at least
    ``device``'s floor of tokens (needs the intermediate size)."""
    assert size.intermediate is not None, "the shard-size rule needs the intermediate size"
    fixed = fixed_bytes(size, num_tokens)
    buffer_bytes = min(SHARD_INTERMEDIATE_BYTES, WORKING_SET_SHARE * fixed / WORKING_SET_BUFFERS)
    tokens_per_shard = max(min_tokens_per_shard(device), int(buffer_bytes // (size.intermediate * size.element_bytes)))
    return max(1, math.ceil(num_tokens / tokens_per_shard))


def estimated_saved_bytes(num_tokens: int, size: MLPSize, num_shards: int) -> float:
    """The bytes ``num_shards`` shards stop holding, net of their own working set (negative: tiling
    would raise the peak). Needs the intermediate size."""
    assert size.intermediate is not None, "the saving is estimated from the intermediate size"
    intermediate_bytes = num_tokens * size.intermediate * size.element_bytes
    if size.generic_trainable_bytes is None:
        # The fast path keeps about WORKING_SET_BUFFERS shard-sized buffers, and only while a shard runs.
        return FAST_SAVED_INTERMEDIATES * intermediate_bytes - WORKING_SET_BUFFERS * intermediate_bytes / num_shards
    # Untiled autograd keeps at least two [tokens, intermediate] tensors (the pre-activation and the
    # activation's output; SwiGLU keeps four); the generic recompute keeps a shard's worth of them (so
    # one shard saves nothing), beside its extra buffers. (The fast path saves no intermediate at all
    # between forward and backward, so even one shard lowers its peak.)
    saved = GENERIC_SAVED_INTERMEDIATES * intermediate_bytes * (1 - 1 / num_shards)
    extra = size.generic_trainable_bytes + 2 * math.ceil(num_tokens / num_shards) * size.hidden * size.element_bytes
    return saved - extra


def auto_decision(num_tokens: int, size: MLPSize, device: DeviceClass = CPU, compiling: bool = False) -> AutoDecision:
    """The shard count for ``num_tokens`` tokens on ``device`` (None: run the module untiled), and why;
    ``compiling``: the call is being traced by ``torch.compile``."""
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
    """``auto_decision`` on these sizes (``device``: ``device_class(x.device)``; None: ``MODELLED_DEVICE``),
    answered from memory when asked before with the same sizes, device and compiling, and the same
    ``policy_inputs()``."""
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
    """The shard count for ``num_tokens`` tokens on ``device``, or None to run the module untiled."""
    return auto_decision(num_tokens, size, device).num_shards
