"""The Axolotl plugin's config keys (``axolotl.TiledMLPPlugin.get_input_args`` names this model).

Axolotl validates its YAML against its own pydantic model extended with each listed plugin's model, and
keeps only the keys some model declares: these are the plugin's. They are prefixed ``tiled_mlp_lib_`` so
that none is Axolotl's own ``tiled_mlp``, ``tiled_mlp_num_shards`` or ``tiled_mlp_use_original_mlp`` (its
built-in tiled MLP, a different implementation). Listing the plugin under ``plugins:`` turns tiling on;
these keys only tune it. Imported by Axolotl while it validates a config, so pydantic is there.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field, field_validator, model_validator

from tiled_mlp.core.shard_plan import parse_num_shards

from .args import parse_bool

PREFIX = "tiled_mlp_lib_"


class TiledMLPLibArgs(BaseModel):
    """tiled-mlp's keys in an Axolotl config (the plugin ``tiled_mlp.integrations.axolotl.TiledMLPPlugin``)."""

    tiled_mlp_lib_num_shards: Optional[Union[int, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: shards per MLP and norm call, 'auto' or an int >= 1"})
    tiled_mlp_lib_loss: Optional[Union[bool, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: tile the LM head + cross entropy (default true)"})
    tiled_mlp_lib_loss_num_shards: Optional[Union[int, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: shards per loss call, 'auto' or an int >= 1"})
    tiled_mlp_lib_norms: Optional[Union[bool, str]] = Field(
        default=None, json_schema_extra={"description": "tiled-mlp: tile the RMSNorms (default true)"})

    @field_validator("tiled_mlp_lib_num_shards", "tiled_mlp_lib_loss_num_shards", mode="before")
    @classmethod
    def _shards(cls, value: Any) -> Any:
        return None if value is None else parse_num_shards(value)

    @field_validator("tiled_mlp_lib_loss", "tiled_mlp_lib_norms", mode="before")
    @classmethod
    def _flag(cls, value: Any, info: Any) -> Any:
        return None if value is None else parse_bool(value, info.field_name)

    @model_validator(mode="before")
    @classmethod
    def _not_with_axolotls_own(cls, data: Any) -> Any:
        # Axolotl's ``tiled_mlp`` patches each MLP class's forward; this plugin tiles the same blocks in place.
        # Both at once would shard an already sharded call: one of the two, named in the error. (This model is
        # part of the config's only where the plugin is listed.)
        if isinstance(data, dict) and data.get("tiled_mlp"):
            raise ValueError("Axolotl's own `tiled_mlp: true` and tiled-mlp's plugin both tile the MLPs: keep one "
                             "(remove `tiled_mlp`, or the plugin from `plugins:`)")
        return data

