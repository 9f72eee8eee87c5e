"""TiledMLP in a model prepared by accelerate's ``Accelerator`` with an FSDP2 plugin (``fsdp_version=2``),
two gloo processes on CPU: the FSDP2 strategy is detected and 3 SGD steps match the untiled run
prepared the same way and the single-process references (fp32 bound, ``fsdp2_cases.fsdp2_tolerance``).

accelerate does not enable FSDP on CPU by itself; ``fsdp2_accelerate_training`` sets the distributed
type explicitly and says why.
"""
from __future__ import annotations

import pytest
import torch

from .fsdp2_reference import fsdp2_reference_run
from .spawn import run_distributed
from .test_fsdp2 import WORLD, check_fsdp2_not_vacuous, check_fsdp2_tiled_ran, fsdp2_mismatches

pytest.importorskip("accelerate")
pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_accelerate_fsdp2_plugin_is_detected_and_trains_correctly(tmp_path):
    from .fsdp2_accelerate_training import CASE, train_with_accelerate

    results = run_distributed(train_with_accelerate, WORLD, tmp_path, timeout=90)
    failures = []
    refs = {label: fsdp2_reference_run(CASE, WORLD, dtype) for label, dtype in (("float32", torch.float32), ("float64", torch.float64))}
    check_fsdp2_not_vacuous(CASE, refs["float64"])
    for rank, runs in enumerate(results):
        check_fsdp2_tiled_ran(CASE, rank, runs["tiled"])
        failures += fsdp2_mismatches(CASE, "untiled", runs["untiled"], runs["tiled"], f"rank {rank}: tiled vs untiled")
        for label, ref in refs.items():
            failures += fsdp2_mismatches(CASE, label, ref, runs["tiled"], f"rank {rank}: tiled vs {label} reference")
            failures += fsdp2_mismatches(CASE, label, ref, runs["untiled"], f"rank {rank}: untiled vs {label} reference")
    assert not failures, "\n".join(failures)
