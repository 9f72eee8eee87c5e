"""LLaMA-Factory: ``run_exp(args, callbacks=[TiledMLPCallback()])``. ``Trainer.__init__`` ends with the callbacks'
``on_init_end``, given the loaded model before the optimizer and accelerate's ``prepare``: it tiles there, in place."""
from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn
from transformers import TrainerCallback

from .args import read_settings
from .framework_settings import LLAMAFACTORY, FrameworkTiling
from .report import TilingReport


class TiledMLPCallback(TrainerCallback):
    """Tiles the MLPs, the RMSNorms and the loss (each on by default) of the model the trainer is built with; bad
    settings or an unchecked LLaMA-Factory release are refused here, before ``run_exp`` loads anything."""

    def __init__(self, num_shards: Any = "auto", loss: Any = True, loss_num_shards: Any = "auto",
                 norms: Any = True) -> None:
        self.tiling = read_settings(FrameworkTiling, dict(num_shards=num_shards, loss=loss,
                                                          loss_num_shards=loss_num_shards, norms=norms))
        LLAMAFACTORY.require()  # before run_exp loads anything; checked again where the model is tiled
        self.report: Optional[TilingReport] = None  # what the last model tiled got
        self._tiled: Optional[weakref.ref] = None  # that model (a callback may serve several run_exp calls)

    def _is_tiled(self, model: Any) -> bool:
        # A wrapper the trainer put around it (DDP, DeepSpeed's engine) holds it as ``.module``.
        tiled = self._tiled() if self._tiled is not None else None
        return tiled is not None and (model is tiled or getattr(model, "module", None) is tiled)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None,
                    **kwargs: Any) -> None:
        if model is None or self._is_tiled(model):
            return
        LLAMAFACTORY.require()
        self.report = self.tiling.apply(model)
        self._tiled = weakref.ref(model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None,
                       **kwargs: Any) -> None:
        if model is not None and not self._is_tiled(model):
            raise RuntimeError(
                "TiledMLPCallback did not tile the model this trainer trains: it tiles when the trainer is built "
                "(on_init_end), so pass it there, run_exp(args, callbacks=[TiledMLPCallback()]), not through "
                "trainer.add_callback afterwards")

