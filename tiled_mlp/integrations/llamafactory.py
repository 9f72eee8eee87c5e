"""LLaMA-Factory: a ``TrainerCallback`` that tiles the model its trainer is built with.

    from llamafactory.train.tuner import run_exp
    from tiled_mlp.integrations.llamafactory import TiledMLPCallback

    run_exp(args, callbacks=[TiledMLPCallback(num_shards="auto")])

``run_exp`` hands its callbacks to the trainer it builds (``CustomSeq2SeqTrainer`` for ``stage: sft``,
``CustomTrainer`` for ``pt``), and transformers' ``Trainer.__init__`` ends with the callbacks' ``on_init_end``,
given the model (after LLaMA-Factory's ``load_model``: adapters attached, dtype set). That is where this
callback tiles it: before ``train()`` builds the optimizer and before accelerate's ``prepare`` wraps the
model (DDP, FSDP2, DeepSpeed), which is the order ``apply_tiled_mlp`` asks for. Tiling is in place, so
the optimizer steps the same parameters under the same names either way.

``on_train_begin`` only checks: a callback added after the trainer was built (``trainer.add_callback``)
never saw ``on_init_end`` with this model, and training it untiled while the user asked for tiling is
refused there, naming the fix.

Importing this module needs transformers (every LLaMA-Factory install has it), not LLaMA-Factory: the
LLaMA-Factory release is checked when the model is tiled (``framework_settings.LLAMAFACTORY``).
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

from torch import nn
from transformers import TrainerCallback

from .framework_settings import LLAMAFACTORY, FrameworkTiling
from .report import TilingReport


class TiledMLPCallback(TrainerCallback):
    """Tiles the MLPs, the RMSNorms and the loss (each on by default) of the model the trainer is built with.

    ``num_shards``/``loss_num_shards``: ``"auto"`` or an int >= 1; a bad value, or a LLaMA-Factory release
    not checked, is refused here, before ``run_exp`` loads anything. ``report`` holds what the last model tiled got.
    """

    def __init__(self, num_shards: Any = "auto", loss: Any = True, loss_num_shards: Any = "auto",
                 norms: Any = True) -> None:
        self.tiling = FrameworkTiling.parse(num_shards, loss, loss_num_shards, norms)
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

