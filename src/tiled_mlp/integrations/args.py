"""Training-script flags: ``--use_tiled_mlp`` and ``--tiled_mlp_num_shards`` (argparse or a dict)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from torch import nn

from ..tiled_core.shard_plan import NumShards, check_num_shards


def parse_num_shards(text: Union[str, int]) -> NumShards:
    """``"auto"`` or an integer >= 1 (argparse ``type=``)."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return value


def add_tiled_mlp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tiled MLP")
    group.add_argument("--use_tiled_mlp", action="store_true",
                       help="run each MLP block in token shards to cut activation memory at long context")
    group.add_argument("--tiled_mlp_num_shards", type=parse_num_shards, default="auto",
                       help="shards per MLP call: an integer, or 'auto' (sized from the sequence length)")
    return parser


@dataclass(frozen=True)
class TiledMLPFlags:
    use_tiled_mlp: bool = False
    num_shards: NumShards = "auto"


def read_tiled_mlp_flags(source: Union[argparse.Namespace, Mapping[str, Any], None]) -> TiledMLPFlags:
    """The flags from parsed arguments or a dict (a YAML/JSON training config); absent keys: defaults."""
    if source is None:
        return TiledMLPFlags()
    values = source if isinstance(source, Mapping) else vars(source)
    num_shards = values.get("tiled_mlp_num_shards")
    try:
        num_shards = "auto" if num_shards is None else parse_num_shards(num_shards)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"tiled_mlp_num_shards: {error}") from None
    check_num_shards(num_shards)
    return TiledMLPFlags(bool(values.get("use_tiled_mlp", False)), num_shards)


def apply_from_flags(model: nn.Module, source, **kwargs) -> Optional["TilingReport"]:  # noqa: F821
    """``apply_tiled_mlp(model, num_shards=...)`` when ``--use_tiled_mlp`` is set, else None."""
    flags = read_tiled_mlp_flags(source)
    if not flags.use_tiled_mlp:
        return None
    from .hf import apply_tiled_mlp

    return apply_tiled_mlp(model, num_shards=flags.num_shards, **kwargs)
