"""Weights saved from a tiled model under DeepSpeed ZeRO load into the untiled model: same names, same
values. Two gloo processes on CPU, fp32, one SGD step (toy model) or two (tiny Llama under HF Trainer).

DeepSpeed names what it exports from ``named_parameters``/``named_children``, not from ``state_dict``,
so a tiling that adds a module level (``layers.0.mlp.mlp.up_proj.weight``) leaks into every export
even when ``state_dict`` hides it. Each export is checked three ways: its keys are exactly the untiled
model's ``state_dict`` keys; it loads into a fresh untiled model with ``strict=True``; its values are
the trained weights (gathered from the ZeRO partitions) and those of the same run untiled.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch

from .spawn import run_distributed
from .toy_models import make_toy_model
from .zero_checkpoints import SHARDS, TRAINER_SHARDS, export_toy_all, trainer_both

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

WORLD = 2
# Tiled and untiled runs sum the same products in another order: ~1e-7 relative in fp32, while one
# step moves every weight by far more than this (checked below).
RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def toy_exports(tmp_path_factory) -> Dict:
    """One spawn for all toy-model tests: ZeRO-3 and ZeRO-2, untiled and tiled, all exports."""
    root = tmp_path_factory.mktemp("zero-exports")
    return run_distributed(export_toy_all, WORLD, root, str(root), timeout=150)[0]


def untiled_keys():
    return sorted(make_toy_model(seed=0).state_dict())


def trained_clearly(trained: torch.Tensor, initial: torch.Tensor) -> bool:
    """Not vacuous: the training moved this weight at least 10x beyond the tiled-vs-untiled tolerance,
    so a tiled run that failed to train it would fail that comparison."""
    return not torch.allclose(trained, initial, rtol=10 * RTOL, atol=10 * ATOL)


def check_export(what: str, export: Dict[str, torch.Tensor], trained: Dict[str, torch.Tensor], keys) -> None:
    """Exact key set, strict load into an untiled model, loaded values == the trained weights."""
    assert export is not None, f"{what}: rank 0 got no export"
    assert sorted(export) == sorted(keys), (
        f"{what}: keys differ from the untiled model's; extra {sorted(set(export) - set(keys))}, "
        f"missing {sorted(set(keys) - set(export))}")
    fresh = make_toy_model(seed=123)  # other weights than the trained ones: loading must replace them
    fresh.load_state_dict(export, strict=True)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=f"{what}: {key}")


@pytest.mark.timeout(200)
def test_zero3_consolidated_state_dict_loads_into_untiled_model(toy_exports):
    """``engine._zero3_consolidated_16bit_state_dict()`` (what Trainer/accelerate save under ZeRO-3)."""
    tiled = toy_exports["runs"][3]["tiled"]
    assert tiled["shards"] == [SHARDS, SHARDS], f"tiling did not run with {SHARDS} shards: {tiled['shards']}"
    check_export("ZeRO-3 consolidated", tiled["consolidated"], tiled["trained"], untiled_keys())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [3, 2])
def test_zero_checkpoint_to_fp32_loads_into_untiled_model(toy_exports, stage):
    """``engine.save_checkpoint`` then ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``."""
    tiled = toy_exports["runs"][stage]["tiled"]
    assert tiled["shards"] == [SHARDS, SHARDS], f"tiling did not run with {SHARDS} shards: {tiled['shards']}"
    check_export(f"ZeRO-{stage} checkpoint -> fp32", tiled["fp32"], tiled["trained"], untiled_keys())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage,export", [(3, "consolidated"), (3, "fp32"), (2, "fp32")])
def test_tiled_export_equals_untiled_export(toy_exports, stage, export):
    """The tiled run saves the weights the untiled run saves after the same step, under the same names."""
    initial = toy_exports["initial"]
    runs = toy_exports["runs"][stage]
    want, got = runs["untiled"][export], runs["tiled"][export]
    what = f"ZeRO-{stage} {export}"
    assert sorted(want) == untiled_keys(), f"{what}: the untiled export itself has other keys"
    for key, value in want.items():
        assert trained_clearly(value, initial[key]), f"{what}: {key} did not train"
    assert sorted(got) == sorted(want), (
        f"{what}: tiled keys differ; extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}")
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL, msg=f"{what}: {key}")


@pytest.mark.timeout(200)
def test_trainer_zero3_save_model_loads_untiled(tmp_path):
    """HF ``Trainer`` with a DeepSpeed ZeRO-3 config dict, 2 processes on CPU, tiny Llama tiled by
    ``apply_tiled_mlp``: ``trainer.save_model(dir)`` (accelerate's ``get_state_dict`` ->
    ``_zero3_consolidated_16bit_state_dict`` -> ``save_pretrained``), then an untiled
    ``LlamaForCausalLM.from_pretrained(dir)`` must report no missing or unexpected key and hold exactly
    the trained weights, which equal those of the same Trainer run untiled.

    On CPU the Trainer runs DeepSpeed only with ``use_cpu=True``. Without it, accelerate's
    ``PartialState`` finds no accelerator to take a distributed backend from, so every process counts
    itself as a world of one (``num_processes=1``, ``process_index=0`` on both ranks), the "auto"
    ``train_batch_size`` is filled for one process, and DeepSpeed (which sees both) stops in
    ``deepspeed.initialize``: ``AssertionError: Check batch related parameters. train_batch_size is not
    equal to micro_batch_per_gpu * gradient_acc_step * world_size 2 != 2 * 1 * 2``. With
    ``use_cpu=True`` accelerate counts both processes and still selects DeepSpeed, which the test
    checks, so it needs neither of the lower levels (a bare accelerate ``Accelerator`` or engine).
    """
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer runs DeepSpeed through it
    runs = run_distributed(trainer_both, WORLD, tmp_path, str(tmp_path / "saved"), timeout=150)
    for rank, run in enumerate(runs):
        for kind in ("untiled", "tiled"):
            assert run[kind]["accelerate"] == ("DistributedType.DEEPSPEED", WORLD, rank), run[kind]["accelerate"]
            assert run[kind]["deepspeed_world"] == WORLD and run[kind]["partitioned"], kind
        blocks = run["tiled"]["blocks"]
        assert [b[2] for b in blocks] == [TRAINER_SHARDS] * 2, f"tiling did not run with {TRAINER_SHARDS} shards: {blocks}"

    loaded = {}
    for kind in ("untiled", "tiled"):
        model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved" / kind, output_loading_info=True)
        problems = {k: sorted(v) for k, v in info.items() if v}
        assert not problems, f"{kind}: from_pretrained into the untiled Llama: {problems}"
        loaded[kind] = model.state_dict()
        trained = runs[0][kind]["trained"]
        assert sorted(loaded[kind]) == sorted(trained), kind
        for key, value in loaded[kind].items():
            torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=f"{kind}: {key}")

    from integration_tests.tiny_models import tiny_model

    initial = tiny_model("llama", seed=0, dtype=torch.float32).state_dict()
    for key, want in loaded["untiled"].items():
        assert trained_clearly(want, initial[key]), f"{key} did not train"
        torch.testing.assert_close(loaded["tiled"][key], want, rtol=RTOL, atol=ATOL, msg=f"tiled vs untiled: {key}")
