"""Training-script flags: ``--use_tiled_mlp``, ``--tiled_mlp_num_shards`` and ``--use_tiled_loss``
(argparse or a dict).

``--use_tiled_mlp`` takes an optional boolean, so both ``--use_tiled_mlp`` and ms-swift's
``--use_tiled_mlp true`` work; a dict (a YAML/JSON training config) may spell it as a bool or a string.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping, Union

from tiled_core.shard_plan import NumShards, parse_num_shards

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
_WORDS = "true/false, 1/0, yes/no or on/off"


def parse_bool(value: Any, name: str = "use_tiled_mlp") -> bool:
    """A flag's value: a bool, the ints 1/0, or true/false, 1/0, yes/no, on/off in any case.

    ``bool("false")`` is True, so a string is never passed to ``bool``: anything else is a ``ValueError``
    naming ``name`` and the accepted values.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"{name} must be a bool or one of {_WORDS} (any case), got {value!r}")


def _bool_arg(text: str) -> bool:
    """argparse ``type=`` for ``--use_tiled_mlp VALUE``."""
    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {_WORDS} (any case), got {text!r}") from None


def num_shards_arg(text: str) -> NumShards:
    """argparse ``type=`` for a shard count: ``parse_num_shards``, its errors as argparse errors."""
    try:
        return parse_num_shards(text)
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_tiled_mlp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tiled MLP")
    group.add_argument("--use_tiled_mlp", type=_bool_arg, nargs="?", const=True, default=False, metavar="BOOL",
                       help="run each MLP block in token shards to cut activation memory at long context; "
                            "bare or with true/false, 1/0, yes/no, on/off (default: off)")
    group.add_argument("--tiled_mlp_num_shards", type=num_shards_arg, default="auto",
                       help="shards per MLP call: an integer, or 'auto' (sized from the sequence length)")
    group.add_argument("--use_tiled_loss", type=_bool_arg, nargs="?", const=True, default=False, metavar="BOOL",
                       help="compute a causal LM's loss (LM head + cross-entropy) in token shards, never holding "
                            "the logits; with labels the model returns no logits (default: off)")
    return parser


@dataclass(frozen=True)
class TiledMLPFlags:
    use_tiled_mlp: bool = False
    num_shards: NumShards = "auto"
    use_tiled_loss: bool = False


def read_tiled_mlp_flags(source: Union[argparse.Namespace, Mapping[str, Any], None]) -> TiledMLPFlags:
    """The flags from parsed arguments or a dict (a YAML/JSON training config).

    Absent keys (or ``None``, a key left empty in YAML) take the defaults. ``use_tiled_mlp`` goes
    through ``parse_bool`` and ``tiled_mlp_num_shards`` through ``parse_num_shards``; a bad value of
    either is a ``ValueError`` naming the key, even when tiling is off.
    """
    if source is None:
        return TiledMLPFlags()
    values = source if isinstance(source, Mapping) else vars(source)
    use = values.get("use_tiled_mlp")
    use = False if use is None else parse_bool(use, "use_tiled_mlp")
    num_shards = values.get("tiled_mlp_num_shards")
    try:
        num_shards = "auto" if num_shards is None else parse_num_shards(num_shards)
    except (ValueError, TypeError) as error:
        raise ValueError(f"tiled_mlp_num_shards: {error}") from None
    use_loss = values.get("use_tiled_loss")
    use_loss = False if use_loss is None else parse_bool(use_loss, "use_tiled_loss")
    return TiledMLPFlags(use, num_shards, use_loss)

