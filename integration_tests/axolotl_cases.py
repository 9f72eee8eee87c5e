"""Axolotl's own ``axolotl.cli.train`` on the tiny local checkpoint, tiled (``TiledMLPPlugin``) or not.

``write_config`` writes the YAML of one run: full fine-tuning, a ``completion`` dataset of words from the
tiny tokenizer, AdamW lr 1e-2, a few steps, float32 (Axolotl's dtype with bf16 and fp16 off). Each run is
its own process (``run_axolotl``), as ``axolotl train`` is: Axolotl's plugin manager is a process-wide singleton.

``RecorderPlugin`` (listed first, in both runs; with ``start(..., float64=True)`` it first puts the model in
float64, the untiled one's loss kept float64 too: ``float64_loss``) keeps each step's loss as the model returned it (a forward
hook: Axolotl prints it to 4 digits) and, after training, the weights and which modules are tiled, in
``record.pt`` in the run's output folder. It is made on first use (Axolotl's loader asks for it by name),
so the test process imports this module without Axolotl's plugin base.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

from .float64_loss import float64_causal_lm_loss
from .tiny_checkpoint import save_tiny_checkpoint, sentences

STEPS = 3
BATCH = 2
ROOT = Path(__file__).resolve().parent.parent
RECORDER = "integration_tests.axolotl_cases.RecorderPlugin"
TILING = "tiled_mlp.integrations.axolotl.TiledMLPPlugin"
FLOAT64 = "TILED_MLP_TEST_FLOAT64"  # "1": RecorderPlugin puts the model in float64 (Axolotl drops unknown YAML keys)


def write_config(root: Path, run: str, tiled: bool, **extra: Any) -> Path:
    model, data = root / "model", root / "data"
    if not (model / "config.json").exists():
        save_tiny_checkpoint(model)
    if not (data / "tiny.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        rows = sentences(STEPS * BATCH, 40, seed=3)
        (data / "tiny.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    config = dict(
        base_model=str(model), tokenizer_config=str(model),
        datasets=[{"path": str(data / "tiny.jsonl"), "ds_type": "json", "type": "completion"}],
        dataset_prepared_path=str(root / f"prepared-{run}"), output_dir=str(root / run), val_set_size=0,
        sequence_len=64, sample_packing=False, micro_batch_size=BATCH, gradient_accumulation_steps=1,
        max_steps=STEPS, num_epochs=1, optimizer="adamw_torch", learning_rate=0.01, lr_scheduler="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", seed=0, bf16=False, fp16=False, tf32=False,
        flash_attention=False, sdp_attention=False, train_on_inputs=True, dataloader_num_workers=0, dataset_num_proc=1,
        plugins=[RECORDER] + ([TILING] if tiled else []), **extra,
    )
    path = root / f"{run}.json"  # YAML is a superset of JSON: Axolotl's loader reads it
    path.write_text(json.dumps(config))
    return path


def start(config: Path, float64: bool = False) -> subprocess.Popen:
    """``python -m axolotl.cli.train CONFIG`` from the repository root, started (``finish`` waits for it): two
    runs side by side take one run's time on two cores."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", WANDB_DISABLED="true", AXOLOTL_DO_NOT_TRACK="1",
               DO_NOT_TRACK="1", **{FLOAT64: "1" if float64 else "0"})
    return subprocess.Popen([sys.executable, "-m", "axolotl.cli.train", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(config: Path, process: subprocess.Popen, timeout: float = 300) -> Dict[str, Any]:
    """The run's ``record.pt`` and its printed output (``stdout``); a ``RuntimeError`` with that output where
    Axolotl failed."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise RuntimeError(f"axolotl train ran past {timeout} s:\n{output[-8000:]}") from None
    if process.returncode != 0:
        raise RuntimeError(f"axolotl train failed ({process.returncode}):\n{output[-8000:]}")
    record = torch.load(Path(json.loads(config.read_text())["output_dir"]) / "record.pt")
    record["stdout"] = output
    return record


def run_axolotl(config: Path, float64: bool = False, timeout: float = 300) -> Dict[str, Any]:
    return finish(config, start(config, float64), timeout)


def _plugin_class() -> type:
    from axolotl.integrations.base import BasePlugin

    class RecorderPlugin(BasePlugin):
        def __init__(self) -> None:
            super().__init__()
            self.losses: List[float] = []

        def post_model_load(self, cfg: Any, model: Any) -> None:
            # Listed before the tiling plugin: it tiles the float64 model the optimizer then steps.
            if os.environ.get(FLOAT64) == "1":
                model.to(torch.float64)
                if TILING not in (cfg.get("plugins") or []):
                    model.loss_function = float64_causal_lm_loss
            model.register_forward_hook(self._keep_loss)

        def _keep_loss(self, _module: Any, _args: Any, out: Any) -> None:
            if torch.is_grad_enabled() and getattr(out, "loss", None) is not None:
                self.losses.append(out.loss.item())

        def post_train(self, cfg: Any, model: Any) -> None:
            torch.save({
                "losses": self.losses,
                "weights": {key: value.detach().clone() for key, value in model.state_dict().items()},
                "tiled": sorted(name for name, module in model.named_modules() if type(module).__name__.startswith("Tiled")),
                "tiled_loss": type(vars(model).get("forward")).__name__,
            }, Path(cfg.output_dir) / "record.pt")

    return RecorderPlugin


_made: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """``RecorderPlugin``, made on first use (Axolotl's plugin loader asks for it by name)."""
    if name != "RecorderPlugin":
        raise AttributeError(name)
    if name not in _made:
        _made[name] = _plugin_class()
    return _made[name]
