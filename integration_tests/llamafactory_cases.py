"""LLaMA-Factory's own ``run_exp`` on the tiny local checkpoint, tiled (``TiledMLPCallback``) or not.

``run_sft`` runs ``stage: sft`` on a local alpaca-format dataset with the ``empty`` template, full
fine-tuning (or LoRA: ``**LORA``), a few steps on CPU. ``Recorder`` (a callback passed with the tiling one) keeps each step's loss
as the model returned it (a forward hook: the logged loss is rounded), the optimizer's parameters at
``on_train_begin`` and the weights after the last step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from transformers import TrainerCallback

from .float64_loss import float64_causal_lm_loss
from .tiny_checkpoint import save_tiny_checkpoint, sentences

STEPS = 3
BATCH = 2


def write_dataset(folder: Path, rows: int = STEPS * BATCH) -> Path:
    """An alpaca-format dataset named ``tiny`` in ``folder`` (``dataset_info.json`` + the rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts, answers = sentences(rows, 12, seed=1), sentences(rows, 20, seed=2)
    data = [{"instruction": p, "input": "", "output": a} for p, a in zip(prompts, answers, strict=True)]
    (folder / "tiny.json").write_text(json.dumps(data))
    (folder / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    return folder


LORA = dict(finetuning_type="lora", lora_target="all", lora_rank=4, lora_dropout=0.0)  # LLaMA-Factory's default kind


def sft_args(root: Path, run: str, **overrides: Any) -> Dict[str, Any]:
    model = root / "model"
    if not (model / "config.json").exists():
        save_tiny_checkpoint(model)
    data = root / "data"
    if not (data / "dataset_info.json").exists():
        write_dataset(data)
    return dict(
        stage="sft", do_train=True, finetuning_type="full", model_name_or_path=str(model),
        dataset="tiny", dataset_dir=str(data), template="empty", cutoff_len=64, overwrite_cache=True,
        output_dir=str(root / run), overwrite_output_dir=True, per_device_train_batch_size=BATCH,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, plot_loss=False, dataloader_num_workers=0,
    ) | overrides


@dataclass
class Upcast(TrainerCallback):
    """Puts the model in float64 when the trainer is built (LLaMA-Factory loads it in float32 on a CPU):
    passed before the tiling callback, so it tiles the float64 model the optimizer then steps. The untiled
    run's loss is kept in float64 too (``float64_loss``)."""

    untiled: bool = False

    def on_init_end(self, args, state, control, model=None, **kwargs):
        model.to(torch.float64)
        if self.untiled:  # on the causal LM itself, under a PEFT wrapper
            causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
            causal_lm.loss_function = float64_causal_lm_loss


@dataclass
class Recorder(TrainerCallback):
    losses: List[float] = field(default_factory=list)
    optimizer_params: set = field(default_factory=set)  # ids of the parameters the optimizer steps
    trainable: set = field(default_factory=set)  # ids of the model's trainable parameters then
    weights: Dict[str, torch.Tensor] = field(default_factory=dict)
    model: Optional[torch.nn.Module] = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self.model = model
        model.register_forward_hook(self._keep_loss)

    def _keep_loss(self, _module, _args, out):
        if torch.is_grad_enabled() and getattr(out, "loss", None) is not None:
            self.losses.append(out.loss.item())

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.optimizer_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.trainable = {id(p) for p in model.parameters() if p.requires_grad}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.weights = {key: value.detach().clone() for key, value in model.state_dict().items()}


def run_sft(root: Path, run: str, tiling: Optional[TrainerCallback] = None, float64: bool = False,
            **overrides: Any) -> Recorder:
    from llamafactory.train.tuner import run_exp

    recorder = Recorder()
    callbacks: List[TrainerCallback] = [Upcast(untiled=tiling is None)] if float64 else []
    callbacks += ([tiling] if tiling is not None else []) + [recorder]
    run_exp(sft_args(root, run, **overrides), callbacks=callbacks)
    return recorder
