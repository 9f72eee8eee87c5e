"""The tiled loss under accelerate's own ``prepare`` (accelerate 1.15/1.16): FSDP2, DeepSpeed ZeRO-3 and DDP,
two gloo processes, the flags through ``add_tiled_mlp_args`` / ``apply_from_flags`` (tiled loss, MLPs and
norms). Two SGD steps on different tokens per rank equal the untiled run prepared the same way and one
process untiled: losses, every parameter's full gradient at each step and every parameter after it (float64
under FSDP2 and DDP; ZeRO-3 takes no float64 and is compared at float32 bounds).

Under FSDP2, accelerate wraps ``[model.norm, lm_head]`` as one unit of their own; the loss runs inside one
call of ``lm_head``, between that unit's hooks, which issue the same all-gathers and reduce-scatters as the
untiled step (``strategies/fsdp2.py``, ``FSDP2Strategy.head_call_sees_graph``).
"""
from __future__ import annotations

import pytest
import torch

from .frameworks import need
from .spawn import run_distributed

pytestmark = pytest.mark.distributed
WORLD = 2


def _mismatches(got: dict, want: dict, what: str, rank: int, rtol: float, atol: float) -> list:
    """Every loss, gradient and parameter of ``got`` that differs from ``want`` (``want``'s losses: the ranks'
    per step, or this rank's own)."""
    failures = []
    for step in range(len(want["grads"])):
        want_loss = want["losses"][step]
        want_loss = want_loss[rank] if isinstance(want_loss, list) else want_loss
        if not torch.allclose(got["losses"][step].double(), want_loss.double(), rtol=rtol, atol=atol):
            failures.append(f"rank {rank} step {step} loss vs {what}: {got['losses'][step]} != {want_loss}")
        for kind in ("grads", "params"):
            assert got[kind][step].keys() == want[kind][step].keys()
            for name, value in want[kind][step].items():
                have = got[kind][step][name].double()
                if not torch.allclose(have, value.double(), rtol=rtol, atol=atol):
                    error = (have - value.double()).abs().max().item()
                    failures.append(f"rank {rank} step {step} {kind} {name} vs {what}: max error {error:.3g}")
    return failures


def _check(backend: str, tmp_path, rtol: float, atol: float, timeout: float) -> list:
    from .accelerate_loss_cases import one_run, reference_run

    untiled, tiled = (run_distributed(one_run, WORLD, tmp_path, backend, kind, timeout=timeout / 2)
                      for kind in (False, True))
    results = [{"untiled": u, "tiled": t} for u, t in zip(untiled, tiled)]
    reference = reference_run(WORLD)
    failures = []
    for rank, runs in enumerate(results):
        failures += _mismatches(runs["tiled"], runs["untiled"], "untiled", rank, rtol, atol)
        failures += _mismatches(runs["tiled"], reference, "one process untiled", rank, rtol, atol)
        failures += _mismatches(runs["untiled"], reference, "one process untiled (the untiled run)", rank, rtol, atol)
    assert not failures, "\n".join(failures)
    return results


@pytest.mark.timeout(120)
def test_tiled_loss_under_accelerate_fsdp2(tmp_path):
    need("accelerate")
    results = _check("fsdp2", tmp_path, rtol=1e-12, atol=1e-14, timeout=100)
    for runs in results:
        # accelerate puts the final norm and the head in one FSDP2 unit of their own
        assert runs["tiled"]["layout"] == {"head_unit": ["model.norm", "lm_head"]} == runs["untiled"]["layout"]
        # The loss inside that unit's hooks: the same all-gathers and reduce-scatters as the untiled step.
        assert runs["tiled"]["collectives"] == runs["untiled"]["collectives"]
        assert all(count["reduce_scatter"] > 0 and count["all_gather"] > 0 for count in runs["tiled"]["collectives"])


@pytest.mark.timeout(120)
def test_tiled_loss_under_accelerate_zero3(tmp_path):
    need("accelerate")
    need("deepspeed")
    _check("zero3", tmp_path, rtol=1e-5, atol=1e-6, timeout=110)


@pytest.mark.timeout(120)
def test_tiled_loss_under_accelerate_ddp(tmp_path):
    need("accelerate")
    _check("ddp", tmp_path, rtol=1e-12, atol=1e-14, timeout=100)
