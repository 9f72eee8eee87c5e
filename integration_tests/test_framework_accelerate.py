"""The tiled loss under accelerate's own ``prepare`` (accelerate 1.15/1.16): FSDP2, DeepSpeed ZeRO-3 and DDP,
two gloo processes, the flags through ``add_tiled_mlp_args`` / ``apply_from_flags`` (tiled loss, MLPs and
norms). Two SGD steps on different tokens per rank equal the untiled run prepared the same way and one
process untiled: losses, every parameter's full gradient at each step and every parameter after it (float64
under FSDP2 and DDP; ZeRO-3 takes no float64 and is compared at float32 bounds).

Under FSDP2, accelerate wraps ``[model.norm, lm_head]`` as one unit of their own; the loss runs inside one
call of ``lm_head``, between that unit's hooks, which issue the same all-gathers and reduce-scatters as the
untiled step (``strategies/fsdp2.py``, ``FSDP2Strategy.head_call``).
"""
from __future__ import annotations

import pytest

from .frameworks import need
from .spawn import run_distributed

pytestmark = pytest.mark.distributed
WORLD = 2


def _check_accelerate_run(backend: str, tmp_path, rtol: float, atol: float, timeout: float, tied: bool = False) -> list:
    from .accelerate_loss_cases import one_run
    from .tiled_loss_steps import step_mismatches, steps_reference_run

    untiled, tiled = (run_distributed(one_run, WORLD, tmp_path, backend, kind, tied, timeout=timeout / 2)
                      for kind in (False, True))
    results = [{"untiled": u, "tiled": t} for u, t in zip(untiled, tiled, strict=True)]
    reference = steps_reference_run(WORLD, tied=tied)
    failures = []
    for rank, runs in enumerate(results):
        failures += step_mismatches(runs["tiled"], runs["untiled"], "untiled", rank, rtol, atol)
        failures += step_mismatches(runs["tiled"], reference, "one process untiled", rank, rtol, atol)
        failures += step_mismatches(runs["untiled"], reference, "one process untiled (the untiled run)", rank, rtol, atol)
    assert not failures, "\n".join(failures)
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tied", [False, True], ids=["own head", "head tied to the embeddings"])
def test_tiled_loss_under_accelerate_fsdp2(tmp_path, tied):
    need("accelerate")
    results = _check_accelerate_run("fsdp2", tmp_path, rtol=1e-12, atol=1e-14, timeout=100, tied=tied)
    # accelerate puts the final norm and the head (with the embeddings where they are tied) in one FSDP2 unit
    unit = ["model.norm", "model.embed_tokens", "lm_head"] if tied else ["model.norm", "lm_head"]
    for runs in results:
        assert runs["tiled"]["layout"] == {"head_unit": unit} == runs["untiled"]["layout"]
        assert runs["tiled"]["final_norm_tiled"] and not runs["untiled"]["final_norm_tiled"]  # the unit's norm too
        # The loss inside that unit's hooks: the same all-gathers and reduce-scatters as the untiled step.
        assert runs["tiled"]["collectives"] == runs["untiled"]["collectives"]
        assert all(count["reduce_scatter"] > 0 and count["all_gather"] > 0 for count in runs["tiled"]["collectives"])


@pytest.mark.timeout(120)
def test_tiled_loss_under_accelerate_zero3(tmp_path):
    need("accelerate")
    need("deepspeed")
    _check_accelerate_run("zero3", tmp_path, rtol=1e-5, atol=1e-6, timeout=110)


@pytest.mark.timeout(120)
def test_tiled_loss_under_accelerate_ddp(tmp_path):
    need("accelerate")
    _check_accelerate_run("ddp", tmp_path, rtol=1e-12, atol=1e-14, timeout=100)
