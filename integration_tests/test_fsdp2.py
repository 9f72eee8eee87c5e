"""TiledMLP under FSDP2 (``fully_shard``): two gloo processes on CPU, ``init_device_mesh("cpu", (2,))``.

Every case trains the toy model (residual SwiGLU block + GEGLU block) for 3 SGD steps, untiled and
tiled, under the same FSDP2 layout. Every full gradient (``full_tensor()``) at every step and every
parameter after every step of the tiled run must equal the untiled FSDP2 run and the single-process
float32 and float64 references, within ``fsdp2_cases.fsdp2_tolerance``; the untiled run is held to the
same bounds, which checks the harness. Many cases share one spawned run (start-up ~5 s).
Ranks with different token counts (and shard counts) finishing within the timeout is the proof that
they do not deadlock.
"""
from __future__ import annotations

import pytest
import torch

from .comparison import rel_error
from .fsdp2_cases import GROUPS, Fsdp2Case, fsdp2_tolerance
from .fsdp2_per_linear import per_linear_outcomes
from .fsdp2_reference import fsdp2_reference_run
from .fsdp2_training import train_fsdp2_cases
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
CASES = {case.name: case for group in GROUPS.values() for case in group}


def fsdp2_relative_errors(want: dict, have: dict) -> dict:
    """``{what: max|have - want| / max|want|}`` for every gradient and every parameter, per step."""
    out = {}
    for step, (want_grads, have_grads) in enumerate(zip(want["grads"], have["grads"], strict=True)):
        assert want_grads.keys() == have_grads.keys(), f"trained parameters differ: {sorted(want_grads)} vs {sorted(have_grads)}"
        for name, ref in want_grads.items():
            out[f"step {step} grad {name}"] = rel_error(ref, have_grads[name])
    for step, (want_params, have_params) in enumerate(zip(want["params"], have["params"], strict=True)):
        for name, ref in want_params.items():
            if (ref == want["initial"][name]).all():  # frozen: must not have moved at all
                out[f"step {step} frozen {name}"] = float((have_params[name] != have["initial"][name]).any())
            else:
                # Relative to the parameter: a gradient error shows in the gradients above; comparing
                # updates (p - p0) would only measure the float32 rounding of p (1 ulp of p is ~1e-5
                # of an update here).
                out[f"step {step} param {name}"] = rel_error(ref, have_params[name])
    return out


def fsdp2_mismatches(case: Fsdp2Case, against: str, want: dict, have: dict, label: str) -> list:
    bound = fsdp2_tolerance(case, against)
    for name, ref in want["initial"].items():
        assert (have["initial"][name].double() == ref.double()).all(), f"{case.name}: {label}: initial {name} differs"
    return [f"{case.name}: {label}: {what}: relative error {err:.3g} > {bound:.3g}"
            for what, err in fsdp2_relative_errors(want, have).items() if not err <= bound]


def check_fsdp2_not_vacuous(case: Fsdp2Case, ref: dict) -> None:
    """The reference really trains: non-zero gradients, every trained parameter moved."""
    assert ref["grads"] and all(g.abs().max() > 0 for step in ref["grads"] for g in step.values()), case.name
    assert all((ref["params"][-1][n] != ref["initial"][n]).any() for n in ref["grads"][0]), case.name


def check_fsdp2_tiled_ran(case: Fsdp2Case, rank: int, tiled: dict) -> None:
    assert tiled["strategies"] == {case.expected_strategy}, (case.name, tiled["strategies"])
    assert tiled["paths"] == {case.expected_path}, (case.name, tiled["paths"])
    want = case.shards(rank)
    assert all(shards == [want, want] for shards in tiled["shards"]), (case.name, rank, tiled["shards"])


REFERENCES = {"float32": torch.float32, "float64": torch.float64}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_tiled_matches_untiled_and_reference_under_fsdp2(group, tmp_path, record_property):
    results = run_distributed(train_fsdp2_cases, WORLD, tmp_path, list(GROUPS[group]), timeout=170)
    failures = []
    for name, runs in results[0].items():
        case = CASES[name]
        refs = {label: fsdp2_reference_run(case, WORLD, dtype) for label, dtype in REFERENCES.items()}
        check_fsdp2_not_vacuous(case, refs["float64"])
        for rank, per_case in enumerate(results):
            check_fsdp2_tiled_ran(case, rank, per_case[name]["tiled"])
            # Every rank holds the same full tensors after the all-gathers.
            assert max(fsdp2_relative_errors(runs["tiled"], per_case[name]["tiled"]).values()) == 0, (name, rank)
        tiled, untiled = runs["tiled"], runs["untiled"]
        failures += fsdp2_mismatches(case, "untiled", untiled, tiled, "tiled vs untiled FSDP2")
        worst = [f"vs untiled FSDP2 {max(fsdp2_relative_errors(untiled, tiled).values()):.2e}"]
        for label, ref in refs.items():
            failures += fsdp2_mismatches(case, label, ref, tiled, f"tiled FSDP2 vs {label} reference")
            # The harness itself: the untiled FSDP2 run must agree with the references too.
            failures += fsdp2_mismatches(case, label, ref, untiled, f"untiled FSDP2 vs {label} reference")
            worst.append(f"vs {label} {max(fsdp2_relative_errors(ref, tiled).values()):.2e} "
                         f"(untiled: {max(fsdp2_relative_errors(ref, untiled).values()):.2e})")
        record_property(name, ", ".join(worst))
        print(f"{name}: max relative error of tiled " + ", ".join(worst))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(90)
def test_per_linear_fully_shard_is_rejected_before_any_work(tmp_path):
    """Each Linear its own FSDP2 unit: rejected, whichever of fully_shard and TiledMLP came first."""
    results = run_distributed(per_linear_outcomes, WORLD, tmp_path, timeout=60)
    for rank, out in enumerate(results):
        for when in ("construction", "forward"):
            message = out[when]
            assert message is not None, f"rank {rank}: per-Linear FSDP2 was not rejected at {when}"
            assert "FSDP2 units of their own" in message and "gate_proj" in message and "down_proj" in message
            assert "fully_shard" in message  # names the fix
        assert out["tiled_ran"] == [(None, None), (None, None)], (rank, out["tiled_ran"])
        assert out["grads"] == [], (rank, out["grads"])
        assert out["all_reduce_after"] == 3.0
