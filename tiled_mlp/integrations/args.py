"""Training-script flags (argparse or a dict), one per piece of the long-sequence stack:
``--use_tiled_mlp``, ``--tiled_mlp_num_shards``, ``--use_tiled_loss``, ``--use_tiled_norms``, ``--use_checkpoint_offload`` and
``--ulysses_sp_size`` (not ms-swift's ``--sequence_parallel_size``, which turns on ms-swift's own SP:
read from the same arguments, both would split the sequence twice).

``--use_tiled_mlp`` takes an optional boolean, so both ``--use_tiled_mlp`` and ms-swift's
``--use_tiled_mlp true`` work; a dict (a YAML/JSON training config) may spell it as a bool or a string.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from tiled_mlp.core.shard_plan import NumShards, parse_num_shards

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
_WORDS = "true/false, 1/0, yes/no or on/off"


def parse_bool(value: Any, name: str = "use_tiled_mlp") -> bool:
    """A flag's value: a bool, the ints 1/0, or true/false, 1/0, yes/no, on/off in any case (never
    ``bool(text)``: ``bool("false")`` is True); anything else is a ``ValueError`` naming ``name``."""
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


def parse_shards(value: Any, name: str) -> NumShards:
    """A shard count (``parse_num_shards``); a bad one is a ``ValueError`` naming ``name``."""
    try:
        return parse_num_shards(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{name}: {error}") from None


def _argparse_type(parse: Callable[[str], Any], message: Optional[str] = None) -> Callable[[str], Any]:
    """argparse ``type=`` for ``parse``: its errors as argparse errors (``message``, given the text, where set)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError) as error:
            raise argparse.ArgumentTypeError(message.format(text=text) if message else str(error)) from None

    return convert


_bool_arg = _argparse_type(parse_bool, f"expected {_WORDS} (any case), got {{text!r}}")


def add_tiled_mlp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("tiled MLP")

    def flag(name: str, text: str) -> None:  # bare, or with a word: ms-swift passes ``--use_tiled_mlp true``
        group.add_argument(name, type=_bool_arg, nargs="?", const=True, default=False, metavar="BOOL", help=text)

    flag("--use_tiled_mlp", "run each MLP block in token shards to cut activation memory at long context; "
                            "bare or with true/false, 1/0, yes/no, on/off (default: off)")
    group.add_argument("--tiled_mlp_num_shards", type=_argparse_type(parse_num_shards), default="auto",
                       help="shards per MLP call: an integer, or 'auto' (sized from the sequence length)")
    flag("--use_tiled_loss", "compute a causal LM's loss (LM head + cross-entropy) in token shards, never holding "
                             "the logits; with labels the model returns no logits (default: off)")
    flag("--use_tiled_norms", "run each hidden-size RMSNorm in token shards too, keeping only its input for backward "
                              "(Hugging Face's keeps float32 copies of it) (default: off)")
    flag("--use_checkpoint_offload", "keep each checkpointed layer's input (all but the last) in host memory "
                                     "until its backward; turns on non-reentrant layer checkpointing if off")
    group.add_argument("--ulysses_sp_size", type=_argparse_type(parse_sp_size), default=1, metavar="N",
                       help="Ulysses sequence parallelism (DeepSpeed's): N ranks share each sequence; needs the "
                            "tiled loss (default: 1, off)")
    return parser


def parse_sp_size(value: Any, name: str = "ulysses_sp_size") -> int:
    """An SP size: an int >= 1 (1 is off), or its decimal text."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (1: no sequence parallelism), got {value!r}")
    return value


@dataclass(frozen=True)
class TiledMLPFlags:
    use_tiled_mlp: bool = False
    num_shards: NumShards = "auto"
    use_tiled_loss: bool = False
    use_checkpoint_offload: bool = False
    ulysses_sp_size: int = 1
    use_tiled_norms: bool = False

    @property
    def asks_for_anything(self) -> bool:
        return (self.use_tiled_mlp or self.use_tiled_loss or self.use_tiled_norms or self.use_checkpoint_offload
                or self.ulysses_sp_size > 1)


def read_tiled_mlp_flags(source: Union[argparse.Namespace, Mapping[str, Any], None]) -> TiledMLPFlags:
    """The flags from parsed arguments or a dict (a YAML/JSON training config); absent keys (or ``None``)
    take the defaults, a bad value is a ``ValueError`` naming the key, even when tiling is off."""
    if source is None:
        return TiledMLPFlags()
    values = source if isinstance(source, Mapping) else vars(source)

    def read(key: str, parse: Callable[[Any, str], Any], default: Any) -> Any:
        value = values.get(key)
        return default if value is None else parse(value, key)

    return TiledMLPFlags(use_tiled_mlp=read("use_tiled_mlp", parse_bool, False),
                         num_shards=read("tiled_mlp_num_shards", parse_shards, "auto"),
                         use_tiled_loss=read("use_tiled_loss", parse_bool, False),
                         use_checkpoint_offload=read("use_checkpoint_offload", parse_bool, False),
                         use_tiled_norms=read("use_tiled_norms", parse_bool, False),
                         ulysses_sp_size=read("ulysses_sp_size", parse_sp_size, 1))
