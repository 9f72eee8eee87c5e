"""The training-script flags of the long-sequence stack, read one way from argparse, a dict (a YAML/JSON training
config), a model's config or the environment. ``--ulysses_sp_size`` is not ms-swift's ``--sequence_parallel_size``
(its own SP: both would split the sequence twice)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, TypeVar, Union

from tiled_mlp.core.shard_plan import NumShards, parse_num_shards

_WORDS = "true/false, 1/0, yes/no or on/off"
Settings = TypeVar("Settings")


def parse_bool(value: Any, name: str = "use_tiled_mlp") -> bool:
    """Never ``bool(text)``: ``bool("false")`` is True."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    word = value.strip().lower() if isinstance(value, str) else None
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{name} must be a bool or one of {_WORDS} (any case), got {value!r}")


def check_switches(where: str, **switches: Any) -> None:
    """A Python entry point's on/off arguments: each a bool. Text is refused, not read (``bool("false")`` is True);
    the flag readers (``parse_bool``, ``read_tiled_mlp_flags``) are where a config's or the environment's words go."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {value!r} ({type(value).__name__}); read a "
                            f"config's or the environment's text with tiled_mlp.integrations.args.parse_bool first")


def parse_sp_size(value: Any, name: str = "ulysses_sp_size") -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (1: no sequence parallelism), got {value!r}")
    return value


def parse_flag(value: Any, name: str, default: Any) -> Any:
    """``value`` parsed as ``default`` is (None: the default); a bad one is a ``ValueError`` naming ``name``."""
    if value is None:
        return default
    if isinstance(default, bool):
        return parse_bool(value, name)
    if default != "auto":
        return parse_sp_size(value, name)
    try:
        return parse_num_shards(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{name}: {error}") from None


def read_settings(cls: type[Settings], values: Mapping[str, Any], prefix: str = "") -> Settings:
    """A settings dataclass from user input, each field under its key (``metadata["key"]``, else its name) after
    ``prefix``; absent or None: the default. A bad value is a ``ValueError`` naming the key, even when off."""
    parsed = {}
    for each in fields(cls):  # type: ignore[arg-type]
        key = prefix + each.metadata.get("key", each.name)
        parsed[each.name] = parse_flag(values.get(key), key, each.default)
    return cls(**parsed)


def _argparse_type(parse: Callable[[str], Any], message: str = "") -> Callable[[str], Any]:
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


@dataclass(frozen=True)
class TiledMLPFlags:
    """The flags, each read from its key: the field's name, but ``tiled_mlp_num_shards``."""

    use_tiled_mlp: bool = False
    num_shards: NumShards = field(default="auto", metadata={"key": "tiled_mlp_num_shards"})
    use_tiled_loss: bool = False
    use_checkpoint_offload: bool = False
    ulysses_sp_size: int = 1
    use_tiled_norms: bool = False

    @property
    def asks_for_anything(self) -> bool:
        return (self.use_tiled_mlp or self.use_tiled_loss or self.use_tiled_norms or self.use_checkpoint_offload
                or self.ulysses_sp_size > 1)


def read_tiled_mlp_flags(source: Union[argparse.Namespace, Mapping[str, Any], None]) -> TiledMLPFlags:
    """The flags from parsed arguments or a dict; a bad value is a ``ValueError`` naming the key, even when off."""
    return read_settings(TiledMLPFlags, {} if source is None else source if isinstance(source, Mapping) else vars(source))
