"""LLaMA-Factory end to end: ``run_exp(args, callbacks=[TiledMLPCallback(...)])`` against the same run
untiled, on the tiny local checkpoint (``llamafactory_cases``), 3 steps of SFT (full, and LoRA) with AdamW on CPU.

Runs in LLaMA-Factory's own environment (it pins transformers <= 5.6.0): see docs/frameworks.md.
"""
from __future__ import annotations

import pytest
import torch

from integration_tests.frameworks import need

SHARDS = 3  # more than one shard per MLP, norm and loss call at these lengths ("auto" would take one)


@pytest.fixture(scope="module")
def lf():
    return need("llamafactory")


def _callback(**kwargs):
    from tiled_mlp.integrations.llamafactory import TiledMLPCallback

    return TiledMLPCallback(num_shards=SHARDS, loss_num_shards=SHARDS, **kwargs)


def _compare_llamafactory_runs(untiled, tiled, loss_rtol, weight_atol):
    """Each step's loss, and every weight after the last step (AdamW, lr 1e-2: a step moves a weight ~1e-2)."""
    assert len(tiled.losses) == len(untiled.losses) == 3
    torch.testing.assert_close(torch.tensor(tiled.losses, dtype=torch.float64),
                               torch.tensor(untiled.losses, dtype=torch.float64), rtol=loss_rtol, atol=0)
    assert tiled.weights.keys() == untiled.weights.keys()  # tiling in place: the same names
    for key, weight in untiled.weights.items():
        torch.testing.assert_close(tiled.weights[key], weight, rtol=0, atol=weight_atol, msg=key)


def _tiled_everything(callback):
    kinds = [block.kind for block in callback.report.blocks]
    assert kinds.count("norm") == 5 and len(kinds) - kinds.count("norm") == 2, kinds  # 2 layers: 2 MLPs, 5 norms
    assert callback.report.tiled_loss is not None


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_float64_tiled_equals_untiled(lf, tmp_path, finetuning):
    from integration_tests.llamafactory_cases import LORA, run_sft

    callback = _callback()
    overrides = LORA if finetuning == "lora" else {}
    untiled = run_sft(tmp_path, "untiled", float64=True, **overrides)
    tiled = run_sft(tmp_path, "tiled", tiling=callback, float64=True, **overrides)
    _tiled_everything(callback)
    assert tiled.optimizer_params == tiled.trainable  # the optimizer steps the tiled model's own parameters
    assert all(w.dtype == torch.float64 for w in tiled.weights.values() if w.is_floating_point())
    _compare_llamafactory_runs(untiled, tiled, loss_rtol=1e-13, weight_atol=1e-13)  # measured: 9e-16 and 2.4e-15 (LoRA: 5.3e-15)


def test_float32_as_llamafactory_loads_it(lf, tmp_path):
    """LLaMA-Factory's own dtype on a CPU (float32): the sharded sums round differently (a loss 1 ulp apart),
    and AdamW carries that into the weights."""
    from integration_tests.llamafactory_cases import run_sft

    callback = _callback()
    untiled = run_sft(tmp_path, "untiled")
    tiled = run_sft(tmp_path, "tiled", tiling=callback)
    _tiled_everything(callback)
    assert next(iter(tiled.weights.values())).dtype == torch.float32
    _compare_llamafactory_runs(untiled, tiled, loss_rtol=1e-6, weight_atol=1e-5)  # measured: 2.3e-7 and 1.6e-6


def test_unchecked_release_is_refused_at_construction_and_before_tiling(lf, tmp_path, monkeypatch):
    import dataclasses

    from integration_tests.llamafactory_cases import run_sft
    from tiled_mlp.integrations import llamafactory
    from tiled_mlp.integrations.framework_settings import FrameworkVersionError

    callback = _callback()  # made while the release is one checked
    monkeypatch.setattr(llamafactory, "LLAMAFACTORY", dataclasses.replace(llamafactory.LLAMAFACTORY, checked=("0.0.1",)))
    with pytest.raises(FrameworkVersionError, match=r"checked on llamafactory 0\.0\.1, not 0\.9\.5"):
        _callback()
    with pytest.raises(FrameworkVersionError, match=r"checked on llamafactory 0\.0\.1, not 0\.9\.5"):
        run_sft(tmp_path, "refused", tiling=callback)
    assert callback.report is None


def test_callback_added_after_the_trainer_is_refused(tmp_path):
    need("llamafactory")
    from tiled_mlp.integrations.llamafactory import TiledMLPCallback

    callback = TiledMLPCallback()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="tiles when the trainer is built"):
        callback.on_train_begin(None, None, None, model=model)
