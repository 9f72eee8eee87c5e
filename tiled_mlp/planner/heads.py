"""What the parallel degrees (``--sp``, ``--tp``) are checked against: a whole number of ranks, and the
attention heads the ranks divide between them."""
from __future__ import annotations

from typing import Tuple


def check_degree(flag: str, degree: object, kind: str) -> None:
    """A ValueError unless ``degree`` is a whole number of ranks, 1 or more."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"{flag} {degree!r}: {kind} parallelism takes a whole number of ranks, 1 or more")


def head_counts(config) -> Tuple[int, int]:
    """The text model's query and key/value head counts (key/value: the query count where it has none)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads
