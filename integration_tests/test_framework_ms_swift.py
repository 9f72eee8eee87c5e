"""ms-swift's real ``swift sft`` CLI, 2 steps of its default LoRA training on a tiny local Qwen2, tiled through the
plugin this package ships (``--external_plugins``) against the same run untiled.

- ``--lora_dropout 0``: the tiled run (MLP blocks in 4 shards, norms tiled) against the untiled run.
- ms-swift's default ``--lora_dropout 0.05``: the tiled run draws each dropout mask shard by shard, so its masks are
  not the untiled run's (it drifts from it: other random draws, not other maths). The reference that draws the
  same masks is the untiled MLP run on the same shards one after another
  (``ms_swift_plugins/shardwise_reference.py``); the tiled backward must replay each shard's masks to match it.

Bound: float32 (ms-swift trains the float32 checkpoint in float32 here), relative 1e-5 on the logged loss and
gradient norm. Both runs do the same per-token arithmetic; only the order of the sums over tokens differs (a
weight gradient summed shard by shard, not in one GEMM), which moves a float32 value by a few units of 1.2e-7.
Measured: equal to ~1e-7. A mask replayed wrongly moves the gradient norm by ~1e-3 (the drift the issue saw).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from integration_tests.frameworks import need

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PLUGIN = Path(__file__).resolve().parent / "ms_swift_plugins" / "shardwise_reference.py"
SHARDS = 4
STEPS = 2
BOUND = 1e-5
TILING = {"use_tiled_mlp": True, "tiled_mlp_num_shards": SHARDS, "use_tiled_norms": True}


def _sft_args(model: Path, data: Path, out: Path, dropout: str) -> list:
    return ["sft", "--model", str(model), "--model_type", "qwen2", "--template", "qwen2_5", "--system", "Count.",
            "--dataset", str(data), "--split_dataset_ratio", "0", "--max_length", "128",
            "--max_steps", str(STEPS), "--logging_steps", "1", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--torch_dtype", "float32", "--fp16", "false", "--bf16", "false",
            "--lora_dropout", dropout, "--seed", "42", "--save_strategy", "no", "--report_to", "none",
            "--dataloader_num_workers", "0", "--check_model", "false",  # no hub look-up for the local model
            "--output_dir", str(out)]


def _swift(args: list, log: Path, env: dict) -> str:
    """Runs ``swift <args>`` (the venv's own CLI), returns its output; fails the test with the output's tail."""
    swift_cli = Path(sys.executable).with_name("swift")
    with open(log, "w") as file:
        done = subprocess.run([str(swift_cli), *args], stdout=file, stderr=subprocess.STDOUT, env=env, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, f"swift {' '.join(args)} failed:\n{text[-4000:]}"
    return text


def _history(out: Path) -> list:
    """The (loss, grad_norm) of each logged step, at full precision (``logging.jsonl``'s last line keeps the
    trainer's ``log_history``; its per-step lines are rounded)."""
    (log,) = out.glob("*/logging.jsonl")
    final = json.loads(log.read_text().splitlines()[-1])
    return [(entry["loss"], entry["grad_norm"]) for entry in final["log_history"] if "grad_norm" in entry]


def _assert_same_steps(want: list, got: list, what: str) -> None:
    assert len(want) == len(got) == STEPS, (want, got)
    for step, (w, g) in enumerate(zip(want, got, strict=True), start=1):
        for name, a, b in zip(("loss", "grad_norm"), w, g, strict=True):
            assert abs(b - a) <= BOUND * abs(a), f"{what}, step {step}: {name} {b!r} against {a!r}"


def test_swift_sft_tiled_equals_untiled(tmp_path):
    need("swift")
    from integration_tests.ms_swift_model import save_tiny_qwen2
    from tiled_mlp.integrations.ms_swift import plugin_path

    model = tmp_path / "model"
    data = save_tiny_qwen2(model)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for name in TILING:
        env.pop(name.upper(), None)
    plugin = ["--external_plugins", plugin_path()]
    # The flags through ms-swift's own --model_kwargs, and (the dropout run) through the environment.
    env_tiling = dict(env, **{name.upper(): str(value).lower() for name, value in TILING.items()})
    runs = {  # name: (dropout, extra arguments, environment)
        "untiled": ("0", [], env),
        "tiled": ("0", plugin + ["--model_kwargs", json.dumps(TILING)], env),
        "reference_dropout": ("0.05", ["--external_plugins", str(REFERENCE_PLUGIN)],
                              dict(env, SHARDWISE_REFERENCE_SHARDS=str(SHARDS))),
        "tiled_dropout": ("0.05", plugin, env_tiling),
    }

    def run(name):
        dropout, extra, run_env = runs[name]
        args = _sft_args(model, data, tmp_path / name, dropout) + extra
        return name, _swift(args, tmp_path / f"{name}.log", run_env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(pool.map(run, runs))
    for name in ("tiled", "tiled_dropout"):
        assert "tiled 2 MLP block(s) and 5 norm(s)" in logs[name], logs[name][-3000:]
    assert "shardwise reference: 2 MLP block(s) in 4 shards" in logs["reference_dropout"]
    history = {name: _history(tmp_path / name) for name in runs}
    _assert_same_steps(history["untiled"], history["tiled"], "lora_dropout 0, tiled against untiled")
    _assert_same_steps(history["reference_dropout"], history["tiled_dropout"],
                  "lora_dropout 0.05, tiled against the untiled run drawing the same masks")
    # Dropout acted (else the second comparison could not see a wrong mask).
    assert abs(history["tiled_dropout"][-1][1] - history["tiled"][-1][1]) > 100 * BOUND * history["tiled"][-1][1]
