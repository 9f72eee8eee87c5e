"""transformers' Trainer with ``label_smoothing_factor``: hand the smoothing to the tiled loss
(docs/long-context-stack.md, "Label smoothing from the Trainer"). Read on transformers ``CHECKED``.
"""
from __future__ import annotations

from typing import Any, NoReturn

from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange

from .causal_lm_loss import set_tiled_loss_label_smoothing, tiled_loss_forward

CHECKED = CheckedRange("transformers", "5.19.0", "5.25.0")


def _refuse(why: str) -> NoReturn:
    raise ValueError(f"use_tiled_label_smoothing: {why}")


def use_tiled_label_smoothing(trainer: Any) -> float:
    """Hand ``trainer``'s label smoothing to the tiled loss on its model and take it off the trainer; returns the
    factor the tiled loss smooths with. Refused before anything changes where the numbers would differ."""
    from transformers import Trainer
    from transformers.trainer_pt_utils import LabelSmoother

    version = checked_versions.installed("transformers")
    if not CHECKED.contains(version):
        _refuse(f"transformers here is {version}; the Trainer's label smoothing was read on "
                f"{CHECKED.describe()} only. Install one of those, or keep the Trainer's own label smoothing")
    if not isinstance(trainer, Trainer):
        _refuse(f"{type(trainer).__name__} is not a transformers Trainer")
    model: Any = trainer.model
    installed = tiled_loss_forward(model)
    if installed is None:
        _refuse(f"no tiled loss on the trainer's model ({type(model).__name__}); apply it first "
                "(apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model))")
    smoother = trainer.label_smoother
    if smoother is None:
        return installed.label_smoothing
    owner = next(k for k in type(trainer).__mro__ if "compute_loss" in vars(k))
    if owner is not Trainer:
        _refuse(f"{owner.__module__}.{owner.__qualname__} computes the loss in a compute_loss of its own, which uses "
                "the label smoother its own way; taking the smoother away would change its loss. Keep its label "
                "smoothing (the tiled loss does not run for it)")
    if trainer.compute_loss_func is not None:
        _refuse("the trainer has a compute_loss_func, which computes the loss from the logits (before the label "
                "smoother); the tiled loss would not run for it")
    if type(smoother) is not LabelSmoother:
        _refuse(f"the trainer's label smoother is a {type(smoother).__qualname__}, not transformers' LabelSmoother, "
                "whose numbers the tiled loss reproduces")
    if smoother.ignore_index != -100:
        _refuse(f"the label smoother ignores {smoother.ignore_index}, the model's loss -100")
    if not trainer.model_accepts_loss_kwargs:
        _refuse("the trainer does not pass num_items_in_batch to this model (model_accepts_loss_kwargs is False), "
                "where its label smoother divides by it: the two losses would be normalised differently")
    if installed.form.router_aux_loss:
        _refuse(f"{type(installed.model).__name__} adds its router's auxiliary loss to its loss; the Trainer's label "
                "smoother computes from the logits alone and leaves it out, so the tiled loss would change the "
                "numbers. Keep the Trainer's label smoothing for this model")
    # The Trainer shifts the labels for its smoother only where the unwrapped model's class is a causal LM of
    # transformers' mapping (Trainer.compute_loss); the tiled loss always shifts them.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer import _is_peft_model

    unwrapped = trainer.accelerator.unwrap_model(model)
    named = unwrapped.base_model.model if _is_peft_model(unwrapped) else unwrapped
    if named._get_name() not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        _refuse(f"the Trainer smooths {named._get_name()}'s labels unshifted (it shifts them only for the causal LMs "
                "of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), the tiled loss shifted: the losses would "
                "differ. Keep the Trainer's label smoothing for this model")
    set_tiled_loss_label_smoothing(model, smoother.epsilon)
    trainer.label_smoother = None
    return installed.label_smoothing
