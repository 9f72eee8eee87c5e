"""The tiled loss where the output head is an FSDP2 unit, or one module of a unit (``fully_shard`` by hand,
two gloo processes, float64): the loss runs inside one call of the head, between its unit's hooks, which
unshard the head once for the whole loss (not once per token shard) and reduce-scatter its gradient once.
Two SGD steps on different tokens per rank equal the untiled run and one process untiled, exactly; every step
issues the untiled step's reduce-scatters, and at most one all-gather more (the model's own call of the head
on no tokens, inside its forward, gathers a head that its unit resharded).

accelerate's own layout (``[norm, lm_head]`` kept after forward) is ``test_framework_accelerate.py``'s.
"""
from __future__ import annotations

import pytest

from .spawn import run_distributed

pytestmark = pytest.mark.distributed
WORLD = 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["head alone, resharded after forward", "head alone, kept after forward",
                                    "norm and head, resharded after forward"])
def test_tiled_loss_inside_the_head_unit_equals_untiled(tmp_path, layout):
    from .fsdp2_head_cases import both_runs
    from .tiled_loss_steps import step_mismatches, steps_reference_run

    results = run_distributed(both_runs, WORLD, tmp_path, layout, timeout=50)
    reference = steps_reference_run(WORLD)
    failures = []
    for rank, runs in enumerate(results):
        failures += step_mismatches(runs["tiled"], runs["untiled"], "untiled", rank, rtol=1e-12, atol=1e-14)
        failures += step_mismatches(runs["tiled"], reference, "one process untiled", rank, rtol=1e-12, atol=1e-14)
        for step, (tiled, untiled) in enumerate(zip(runs["tiled"]["collectives"], runs["untiled"]["collectives"],
                                                    strict=True)):
            assert tiled["reduce_scatter"] == untiled["reduce_scatter"] > 0, (rank, step, tiled, untiled)
            assert untiled["all_gather"] <= tiled["all_gather"] <= untiled["all_gather"] + 1, (rank, step, tiled, untiled)
    assert not failures, "\n".join(failures)
