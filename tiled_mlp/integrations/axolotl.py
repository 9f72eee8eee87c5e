"""Axolotl: a plugin that tiles the model Axolotl loaded (docs/frameworks.md, "Axolotl"), named under
``plugins:`` as ``tiled_mlp.integrations.axolotl.TiledMLPPlugin``, tuned by ``tiled_mlp_lib_*`` keys
(``axolotl_args``; Axolotl's own ``tiled_mlp`` keys are its built-in tiled MLP, refused beside this plugin).

``ModelLoader.load`` calls ``post_model_load(cfg, model)`` once the model is built, its adapters attached,
and before the trainer exists: the plugin tiles there, in place. ``TiledMLPPlugin`` subclasses Axolotl's
``BasePlugin`` and is made on first use (a lazy module attribute), so importing this module does not import
Axolotl; the release is checked in ``pre_model_load`` and again where it tiles (``framework_settings.AXOLOTL``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from .framework_settings import AXOLOTL, FrameworkTiling
from .report import TilingReport

ARGS_MODEL = "tiled_mlp.integrations.axolotl_args.TiledMLPLibArgs"
KEY_PREFIX = "tiled_mlp_lib_"


def settings_from(cfg: Any) -> FrameworkTiling:
    """The tiling a (validated) Axolotl config asks for; absent keys take the defaults."""
    def get(name: str) -> Any:
        return cfg.get(KEY_PREFIX + name) if hasattr(cfg, "get") else getattr(cfg, KEY_PREFIX + name, None)

    return FrameworkTiling.parse(get("num_shards"), get("loss"), get("loss_num_shards"), get("norms"),
                                 prefix=KEY_PREFIX)


class _TilesAfterLoad:
    """The plugin's hooks; ``TiledMLPPlugin`` is this class with Axolotl's ``BasePlugin`` under it."""

    report: Optional[TilingReport] = None  # what the model got

    def get_input_args(self) -> str:
        return ARGS_MODEL

    def pre_model_load(self, cfg: Any) -> None:
        AXOLOTL.require()  # refused before Axolotl spends time loading the model
        settings_from(cfg)

    def post_model_load(self, cfg: Any, model: Any) -> None:
        AXOLOTL.require()
        self.report = settings_from(cfg).apply(model)


def _plugin_class() -> type:
    from axolotl.integrations.base import BasePlugin

    return type("TiledMLPPlugin", (_TilesAfterLoad, BasePlugin), {
        "__module__": __name__,
        "__qualname__": "TiledMLPPlugin",
        "__doc__": "Axolotl plugin: tiles the loaded model's MLPs, RMSNorms and loss in post_model_load "
                   "(see the module docstring).",
    })


_made: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "TiledMLPPlugin":
        if name not in _made:
            _made[name] = _plugin_class()
        return _made[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
