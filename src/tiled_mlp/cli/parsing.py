"""Argument types for the CLI: each rejects bad input with a message that says what is expected."""
from __future__ import annotations

import argparse
import re

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
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


def shards(text: str):
    return "auto" if text == "auto" else positive_int(text)


def byte_size(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 8GiB, 512MiB or 2GB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive, got {text!r}")
    return int(value)
