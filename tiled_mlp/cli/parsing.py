"""Argument types for the CLI: each rejects bad input with a message that says what is expected."""
from __future__ import annotations

import argparse
import math
import re
from typing import List

import torch

from tiled_mlp.core.shard_plan import NumShards, parse_num_shards

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
# accelerate's ``max_memory`` units (``accelerate.utils.convert_file_size_to_int``): KiB, MiB, GiB are
# powers of 2, KB, MB, GB powers of 10, any case. A bare number is GiB here (accelerate reads an int as
# bytes, which no one means by a budget). What accelerate reads as bits ("80Gb") or refuses ("80G")
# is refused, with the accepted forms.
_UNITS = {"": 2**30, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BYTE_SIZE_FORMS = "80 (GiB), 80GiB (80 x 2^30 bytes), 80GB (80 x 10^9 bytes), 512MiB, 512MB, 1TiB, 1TB or 4096B"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a learning rate): 'nan', 'inf', 0 and negatives are mistakes."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def seq_list(text: str) -> list:
    """'2048,8192' -> [2048, 8192]; every length must be a positive integer."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated sequence lengths, e.g. 2048,8192")
    out = []
    for part in parts:
        try:
            out.append(positive_int(part.strip()))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"sequence lengths must be positive integers, got {part.strip()!r}") from None
    return out


def dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of {', '.join(sorted(DTYPES))}"
        ) from None


def shards(text: str) -> NumShards:
    """``parse_num_shards`` (the one parser of a shard count), its errors as argparse errors."""
    try:
        return parse_num_shards(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def byte_size(text: str) -> int:
    """A size in accelerate's ``max_memory`` forms, or a bare number of GiB -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2) if match else ""
    if match is None or unit.lower() not in _UNITS:
        why = "; 'G' alone could mean GB or GiB, 7% apart" if unit.lower() in ("k", "m", "g", "t") else ""
        raise argparse.ArgumentTypeError(f"expected a size: {BYTE_SIZE_FORMS}; got {text!r}{why}")
    if len(unit) > 1 and unit.endswith("b") and not unit.lower().endswith("ib"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: accelerate reads a lowercase b as bits; write {match.group(1)}{unit[:-1].upper()}B "
            f"or {match.group(1)}{unit[:-1].upper()}iB ({BYTE_SIZE_FORMS})")
    value = float(match.group(1)) * _UNITS[unit.lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"the budget must be positive, got {text!r}")
    return int(value)


def attention_shape_error(hidden: int, heads: int, heads_from: str) -> str:
    """Why ``hidden`` features cannot be split over ``heads`` rotary attention heads ('' when they can)."""
    if hidden % heads:
        return (f"--hidden {hidden} is not a multiple of {heads_from} ({heads}): each head takes hidden / heads "
                f"features; use a multiple of {2 * heads}, e.g. {max(1, round(hidden / (2 * heads))) * 2 * heads}")
    if (hidden // heads) % 2:
        return (f"--hidden {hidden} over {heads_from} ({heads}) gives heads of {hidden // heads} features, and rotary "
                f"position embeddings need an even head size; use a multiple of {2 * heads}, "
                f"e.g. {max(1, round(hidden / (2 * heads))) * 2 * heads}")
    return ""


# -- devices: checked before any work, naming what this machine has ------------------------------------
_ACCELERATORS = ("cuda", "xpu", "mps", "npu", "mlu", "hpu", "mtia")


def _is_available(kind: str) -> bool:
    """``torch.<kind>.is_available()`` (``torch.backends.mps`` for mps); False where torch has no such backend."""
    for owner in (getattr(torch, kind, None), getattr(torch.backends, kind, None)):
        is_available = getattr(owner, "is_available", None)
        if callable(is_available):
            try:
                return bool(is_available())
            except Exception:  # a half-installed backend can raise instead of answering
                return False
    return False


def available_devices() -> List[str]:
    """'cpu', then each accelerator type torch reports available, with its indexes when it has several."""
    names = ["cpu"]
    for kind in _ACCELERATORS:
        if not _is_available(kind):
            continue
        module = getattr(torch, kind, None)
        try:
            count = getattr(module, "device_count", lambda: 1)()
        except Exception:
            count = 1
        names.append(kind)
        if count > 1:
            names += [f"{kind}:{i}" for i in range(count)]
    return names


def check_device(text: str, model_memory: bool = False) -> torch.device:
    """The device ``text`` names; a ValueError naming the available ones when it is unknown or absent.

    With ``model_memory`` (fake tensors) the device need not be present, only known to torch.
    """
    available = ", ".join(available_devices())
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"unknown device {text!r}; available here: {available}") from None
    if device.type == "cpu" or model_memory:
        return device
    if not _is_available(device.type):
        raise ValueError(f"device {text!r} is not available on this machine; available here: {available}")
    count = getattr(getattr(torch, device.type, None), "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise ValueError(f"device {text!r} does not exist; available here: {available}")
    return device
