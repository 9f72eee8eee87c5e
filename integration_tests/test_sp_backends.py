"""Ulysses SP where it meets the backend's gradient reduction, DeepSpeed's groups and the batch: every
configuration is exact against one process on the whole sequence, or refused with an error that names the fix
(``sp_backend_cases``: one spawned pair of gloo processes for every case)."""
from __future__ import annotations

import pytest

from .comparison import BOUND, needs_deepspeed, rel_error
from .sp_backend_cases import CASE, DEEPSPEED_EXACT, FLOAT32_BOUND, WRAPPED_EXACT
from .sp_cases import reference_step, sp_sample
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    from .sp_backend_cases import backend_runs

    return run_distributed(backend_runs, 2, tmp_path_factory.mktemp("sp-backends"), timeout=150)


def worst(want: dict, have: dict) -> dict:
    assert want.keys() == have.keys()
    return {name: rel_error(want[name], have[name]) for name in want}


def assert_refused(outcomes, case: str, kind: str, *words: str) -> None:
    for rank, out in enumerate(outcomes):
        got_kind, message = out[case]["error"]
        assert got_kind == kind and all(w in message for w in words), (rank, case, out[case]["error"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", list(DEEPSPEED_EXACT) + [f"wrapped-{name}" for name in WRAPPED_EXACT])
def test_deepspeed_reduction_read_from_the_engine_is_exact(outcomes, config):
    """ZeRO-3 without reduce-scatter, a float32 stage 0 and ZeRO-1 sum over the SP ranks, ZeRO-3's reduce-scatter
    (and ZeRO-3 without it nor contiguous gradients) averages: each read from the engine (or, with the engine on
    a module above the LM, from the ZeRO optimizer), each the whole sequence's gradient."""
    ids, labels = sp_sample(CASE, 0, 0)
    ref = reference_step("llama", ids, labels)["grads"]
    for rank, out in enumerate(outcomes):
        assert "grads" in out[config], (rank, config, out[config])
        errs = worst(ref, out[config]["grads"])
        print(f"{config}: rank {rank}: worst relative error {max(errs.values()):.2e}")
        assert max(errs.values()) <= FLOAT32_BOUND, (rank, config, {k: v for k, v in errs.items() if v > FLOAT32_BOUND})


@pytest.mark.timeout(180)
def test_deepspeed_without_a_single_factor_is_refused(outcomes):
    assert_refused(outcomes, "zero3-no-reduce-scatter-mixed-buckets", "UnsupportedBackendError",
                   "reduce_bucket_size (100)", "model.embed_tokens.weight", "reduce_scatter: true",
                   "reduce_bucket_size >= 1024")
    assert_refused(outcomes, "zero1-predivide", "UnsupportedBackendError", "gradient_predivide_factor 2.0",
                   "leave gradient_predivide_factor at 1.0")
    # stage 0 links nothing to the parameters: under a wrapper its reduction cannot be read
    assert_refused(outcomes, "wrapped-zero0-float32", "UnsupportedBackendError", "no DeepSpeed engine wraps LlamaForCausalLM",
                   "deepspeed.initialize(model=model, mpu=sp.mpu")


@pytest.mark.timeout(180)
def test_ddp_and_fsdp2_that_do_not_span_the_sp_ranks_are_refused(outcomes):
    assert_refused(outcomes, "ddp-own-rank-group", "UnsupportedBackendError", "DDP averages", "[0, 1]",
                   "over every rank")
    assert_refused(outcomes, "fsdp2-own-rank-mesh", "UnsupportedBackendError", "FSDP2 averages", "[0, 1]",
                   "mesh over every rank")


@pytest.mark.timeout(180)
def test_remove_gives_deepspeed_back_its_groups(outcomes):
    """After an engine built with the SP groups is destroyed and SP removed, a plain deepspeed.initialize
    builds an engine without SP."""
    for rank, out in enumerate(outcomes):
        assert out["plain-after-remove"] == {"slot_restored": True, "plain_engine": "built", "plain_sp_size": 1}, rank


@pytest.mark.timeout(180)
def test_batch_size_other_than_the_micro_batch_is_refused_and_named(outcomes):
    for rank, out in enumerate(outcomes):
        for where in ("shard", "forward"):
            kind, message = out["batch-of-two"][where]["error"]
            assert kind == "ValueError" and "micro_batch_size=2" in message, (rank, where, message)


@pytest.mark.timeout(180)
def test_batch_of_two_with_micro_batch_size_two_is_exact(outcomes):
    from .sp_backend_cases import _batch_of_two_reference

    ref = _batch_of_two_reference()
    for rank, out in enumerate(outcomes):
        errs = worst(ref, out["batch-of-two-micro-batch-2"]["grads"])
        print(f"batch of two: rank {rank}: worst relative error {max(errs.values()):.2e}")
        assert max(errs.values()) <= BOUND, (rank, {k: v for k, v in errs.items() if v > BOUND})


@pytest.mark.timeout(180)
def test_whole_sequence_on_every_rank_is_refused(outcomes):
    """shift_labels made by hand and shard() forgotten: the model is called without the slice's positions."""
    assert_refused(outcomes, "whole-sequence-on-every-rank", "ValueError", "without position_ids", "sp.shard(batch)")
