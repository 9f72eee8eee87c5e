"""Axolotl: a plugin, listed under ``plugins:`` as ``tiled_mlp.integrations.axolotl.TiledMLPPlugin``, that tiles the
model in ``post_model_load`` (built, adapters attached, no trainer yet), tuned by ``tiled_mlp_lib_*`` keys. The
plugin class is made on first use, so importing this module does not import Axolotl."""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from .args import parse_flag, read_settings
from .framework_settings import AXOLOTL, FrameworkTiling
from .report import TilingReport

KEY_PREFIX = "tiled_mlp_lib_"


class TiledMLPLibArgs(BaseModel):
    """The plugin's keys in an Axolotl config, prefixed so that none is Axolotl's own (built-in) ``tiled_mlp*``."""

    tiled_mlp_lib_num_shards: Optional[Union[int, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: shards per MLP and norm call, 'auto' or an int >= 1"})
    tiled_mlp_lib_loss: Optional[Union[bool, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: tile the LM head + cross entropy (default true)"})
    tiled_mlp_lib_loss_num_shards: Optional[Union[int, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: shards per loss call, 'auto' or an int >= 1"})
    tiled_mlp_lib_norms: Optional[Union[bool, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: tile the RMSNorms (default true)"})

    @field_validator("tiled_mlp_lib_num_shards", "tiled_mlp_lib_loss", "tiled_mlp_lib_loss_num_shards",
                     "tiled_mlp_lib_norms", mode="before")
    @classmethod
    def _parsed(cls, value: Any, info: Any) -> Any:
        return parse_flag(value, info.field_name, getattr(FrameworkTiling, info.field_name[len(KEY_PREFIX):]))

    @model_validator(mode="before")
    @classmethod
    def _not_with_axolotls_own(cls, data: Any) -> Any:
        # Axolotl's ``tiled_mlp`` patches each MLP class's forward: both would shard an already sharded call.
        if isinstance(data, dict) and data.get("tiled_mlp"):
            raise ValueError("Axolotl's own `tiled_mlp: true` and tiled-mlp's plugin both tile the MLPs: keep one "
                             "(remove `tiled_mlp`, or the plugin from `plugins:`)")
        return data


def settings_from(cfg: Any) -> FrameworkTiling:
    return read_settings(FrameworkTiling, cfg if hasattr(cfg, "get") else vars(cfg), prefix=KEY_PREFIX)


class _TilesAfterLoad:
    report: Optional[TilingReport] = None  # what the model got

    def get_input_args(self) -> str:
        return f"{__name__}.TiledMLPLibArgs"

    def pre_model_load(self, cfg: Any) -> None:
        AXOLOTL.require()  # refused before Axolotl spends time loading the model
        settings_from(cfg)

    def post_model_load(self, cfg: Any, model: Any) -> None:
        AXOLOTL.require()
        self.report = settings_from(cfg).apply(model)


_made: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name != "TiledMLPPlugin":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        from axolotl.integrations.base import BasePlugin

        _made[name] = type(name, (_TilesAfterLoad, BasePlugin), {"__module__": __name__, "__qualname__": name})
    return _made[name]
