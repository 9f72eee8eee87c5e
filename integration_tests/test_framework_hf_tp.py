"""Hugging Face's own tensor parallelism (``from_pretrained(path, tp_plan="auto")``, 2 gloo processes, float64)
tiled with ``apply_tiled_mlp(model, loss=True, norms=True)``: the gated fast kernel on each rank's local weights,
the tiled norms and the vocabulary-parallel tiled loss, 2 SGD steps with momentum, against the same checkpoint
trained untiled in one process: the loss, every gradient (``full_tensor()``) and every parameter after the
steps. The generic kernel (the MLP's own forward, HF's collectives once per shard) matches too; a style the
seam does not prove, and a transformers version it was not checked on, are refused (``hf_tp_cases.py``)."""
from __future__ import annotations

import pytest

from .frameworks import need
from .hf_tp_cases import SHARDS, save_tiny_llama
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
# float64 end to end: the tiled runs sum the same products in another order (shards, the all-reduce of two ranks).
BOUND = 1e-10
MLPS = ("model.layers.0.mlp", "model.layers.1.mlp")
NORMS = ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
         "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm")


def _assert_exact_errors(errors: dict, what: str) -> None:
    bad = {key: error for key, error in errors.items() if not error <= BOUND}
    assert not bad, (what, bad)
    assert any(key.startswith("grad1.") for key in errors), errors  # every gradient of both steps compared


@pytest.mark.timeout(60)
def test_hf_tensor_parallel_model_tiled_with_loss_and_norms_equals_one_process(tmp_path):
    _checked_here()
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    cases = ["untiled", "tiled", "defaults", "unchecked_version"]
    for rank_results in run_distributed(_cases_of, WORLD, tmp_path, path, cases, timeout=55):
        _assert_exact_errors(rank_results["untiled"]["errors"], "HF tensor parallelism untiled")
        _assert_exact_errors(rank_results["defaults"]["errors"], "apply_tiled_mlp(model, loss=True, norms=True)")
        tiled = rank_results["tiled"]
        _assert_exact_errors(tiled["errors"], "tiled")
        # The report says what runs, before the first forward and after it.
        for name in MLPS:
            assert tiled["expected"][name].startswith("fast ("), (name, tiled["report"])
            path_run, shards, reason = tiled["ran"][name]
            assert (path_run, shards) == ("fast", SHARDS) and "kernel 'fast'" in reason, (name, tiled["ran"][name])
        for name in NORMS:
            assert tiled["expected"][name].startswith("norm ("), (name, tiled["report"])
            assert tiled["ran"][name][:2] == ("norm", SHARDS), (name, tiled["ran"][name])
        assert "loss    LlamaForCausalLM: tiled LM head" in tiled["report"], tiled["report"]
        assert tiled["head_strategy"] == "TensorParallelHeadStrategy"
        assert tiled["logits_returned"] == [False, False]  # the tiled loss computed the loss: no logits
        _refused_naming_versions(rank_results["unchecked_version"])


@pytest.mark.timeout(60)
def test_hf_tensor_parallel_mlp_on_the_generic_kernel_equals_one_process(tmp_path):
    _checked_here()
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    for rank_results in run_distributed(_cases_of, WORLD, tmp_path, path, ["generic", "unproven_style"], timeout=55):
        # A style the seam does not prove (a subclass of HF's ColwiseParallel) runs on no kernel: refused, as the
        # report says at tiling, never computed on a layout nothing checked.
        unproven = rank_results["unproven_style"]
        assert unproven["report"].startswith("refused at the first forward"), unproven
        assert "Hugging Face's MyColwise" in unproven["report"], unproven
        assert "no registered kernel runs TiledLlamaMLP" in unproven["raised"], unproven
        assert "gate_proj (Hugging Face's MyColwise)" in unproven["raised"], unproven
        generic = rank_results["generic"]
        _assert_exact_errors(generic["errors"], "generic")
        for name in MLPS:
            assert generic["expected"][name] == "generic (requested)", generic["report"]
            assert generic["ran"][name][:2] == ("generic", SHARDS), (name, generic["ran"][name])


@pytest.mark.timeout(60)
def test_hf_tensor_parallel_from_a_transformers_version_not_checked_is_refused_at_tiling(tmp_path):
    transformers = need("transformers")
    from tiled_mlp.strategies.hf_tensor_parallel import version_checked

    if version_checked():
        pytest.skip(f"transformers {transformers.__version__} is checked (its refusal of another version is in the "
                    "test above)")
    path = str(tmp_path / "tiny-llama")
    save_tiny_llama(path)
    for rank_results in run_distributed(_cases_of, WORLD, tmp_path, path, ["unchecked_version"], timeout=55):
        _refused_naming_versions(rank_results["unchecked_version"])


def _checked_here() -> None:
    transformers = need("transformers")
    from tiled_mlp.strategies.hf_tensor_parallel import CHECKED_VERSIONS, version_checked

    if not version_checked():
        pytest.skip(f"the seam proves HF's tensor parallelism on transformers {', '.join(CHECKED_VERSIONS)}, not "
                    f"{transformers.__version__} (refused at tiling: the test below)")


def _refused_naming_versions(case: dict) -> None:
    refusal = case["refusal"]
    assert f"under transformers {case['installed']};" in refusal, case
    assert f"on transformers {case['checked']} only" in refusal, case


def _cases_of(rank: int, world_size: int, path: str, cases: list) -> dict:
    from .hf_tp_cases import run_hf_tp

    return run_hf_tp(rank, world_size, path, cases)
