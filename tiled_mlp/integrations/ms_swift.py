"""ms-swift: tile the model ``swift sft`` builds, through ``--external_plugins`` (docs/ms-swift.md). The plugin file
(``python -m tiled_mlp.integrations.ms_swift`` prints its path) wraps ``SwiftSft.prepare_model``, the one ms-swift
internal this seam touches, and reads ``apply_from_flags``' flags from ``--model_kwargs`` or else the environment
(upper-cased). It tiles only on the releases and in the pipeline it was checked on, refusing others before any work."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from torch import nn

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import checked_on, in_any

from .args import TiledMLPFlags, read_tiled_mlp_flags
from .stack import LongContextStack, apply_from_flags

CHECKED_VERSIONS = ("4.6.0",)
CHECKED_PIPELINES = ("SwiftSft",)  # `swift sft`; RLHF also prepares reward and reference models through it
# What was checked end to end under ms-swift's trainer: the MLP blocks and the norms.
FLAGS = ("use_tiled_mlp", "tiled_mlp_num_shards", "use_tiled_norms")
# Not checked under ms-swift: its trainer computes the loss and token accuracy from the logits (which the tiled
# loss never forms), has its own sequence parallelism, and checkpoints reentrantly.
UNCHECKED_FLAGS = ("use_tiled_loss", "ulysses_sp_size", "use_checkpoint_offload")
# In a folder of its own: ms-swift puts a plugin's folder first on ``sys.path``, where ``hf``, ``args``... would shadow.
PLUGIN_FILE = Path(__file__).with_name("ms_swift_plugin") / "tiled_mlp_ms_swift.py"
_MARK = "__tiled_mlp_wrapped__"


def plugin_path() -> str:
    return str(PLUGIN_FILE)


def read_flags(model_kwargs: Optional[Mapping[str, Any]], environ: Mapping[str, str] = os.environ) -> TiledMLPFlags:
    """Each flag from ``model_kwargs`` (any key case), else from ``environ`` upper-cased."""
    given = {str(key).lower(): value for key, value in (model_kwargs or {}).items()}
    return read_tiled_mlp_flags({name: given.get(name, environ.get(name.upper())) for name in FLAGS + UNCHECKED_FLAGS})


def check_supported(version: str, pipeline: str, flags: TiledMLPFlags) -> None:
    if not in_any(checked_on("ms-swift", CHECKED_VERSIONS, exact=True), version):
        raise RuntimeError(
            f"tiled-mlp's ms-swift plugin was checked on ms-swift {', '.join(CHECKED_VERSIONS)}, not {version}: "
            f"install ms-swift=={CHECKED_VERSIONS[-1]}, or leave the tiling flags unset")
    if pipeline not in CHECKED_PIPELINES:
        raise RuntimeError(
            f"tiled-mlp's ms-swift plugin was checked with `swift sft` ({', '.join(CHECKED_PIPELINES)}), not "
            f"{pipeline}: leave the tiling flags unset there")
    asked = [name for name in UNCHECKED_FLAGS if getattr(flags, name) != getattr(TiledMLPFlags, name)]
    if asked:
        raise RuntimeError(
            f"tiled-mlp's ms-swift plugin does not apply {', '.join(asked)}: not checked under ms-swift's trainer, "
            f"which computes the loss and token accuracy from the logits and checkpoints reentrantly; it applies "
            f"{', '.join(FLAGS)} (leave the others unset; ms-swift has its own --sequence_parallel_size)")


def tile_prepared_model(model: nn.Module, args: Any, pipeline: str, version: str,
                        log: Callable[[str], Any] = print) -> Optional[LongContextStack]:
    """Tile what ``prepare_model`` returned as the flags ask; None when they ask for nothing."""
    flags = read_flags(getattr(args, "model_kwargs", None))
    if not flags.asks_for_anything:
        return None
    check_supported(version, pipeline, flags)
    handle = apply_from_flags(model, flags)
    if handle is not None:
        log(str(handle.report))
    return handle


def install() -> None:
    """Wrap ``SwiftSft.prepare_model`` (once; importing the plugin file again changes nothing)."""
    from swift.pipelines.train.sft import SwiftSft
    from swift.utils import get_logger

    version = checked_versions.installed("ms-swift") or "unknown"
    current = getattr(SwiftSft, "prepare_model", None)
    if getattr(current, _MARK, False):
        return
    original = getattr(current, "__func__", None)  # a classmethod is bound to the class on lookup
    if original is None:
        raise RuntimeError(f"tiled-mlp's ms-swift plugin: ms-swift {version} has no classmethod "
                           f"SwiftSft.prepare_model (checked on {', '.join(CHECKED_VERSIONS)}): "
                           f"install ms-swift=={CHECKED_VERSIONS[-1]}")

    @functools.wraps(original)
    def prepare_model(cls, args, model, *rest, **options):
        model = original(cls, args, model, *rest, **options)
        tile_prepared_model(model, args, cls.__name__, version, log=get_logger().info)
        return model

    setattr(prepare_model, _MARK, True)
    SwiftSft.prepare_model = classmethod(prepare_model)


if __name__ == "__main__":
    print(plugin_path())
