"""TiledMLP under DeepSpeed ZeRO 1, 2 and 3: two gloo processes on CPU, 3 optimizer steps.

Every full gradient (``safe_get_full_grad``) at every step, and every parameter after every step,
of the tiled run must equal the untiled run of the same case (same seed, same data, same DeepSpeed
config), within ``zero_cases.zero_tolerance``. DeepSpeed's own TiledMLP runs beside ours as a peer; what
it does is recorded, not asserted.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from .spawn import run_distributed
from .zero_cases import GROUPS, PEER_CASES, ZeroCase, zero_tolerance
from .zero_training import train_zero_cases

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

WORLD = 2
CASES = {case.name: case for group in GROUPS.values() for case in group}


def zero_mismatches(case: ZeroCase, ref: dict, got: dict) -> list:
    """Every way ``got`` differs from ``ref`` beyond the case's bound, as readable lines."""
    rtol, atol = zero_tolerance(case)
    out = []

    def check(what: str, want: torch.Tensor, have: torch.Tensor) -> None:
        bound = rtol * want.abs().max().item() + atol
        err = (have - want).abs().max().item() if have.shape == want.shape else float("inf")
        if not err <= bound:
            out.append(f"{case.name}: {what}: max |diff| {err:.3g} > bound {bound:.3g}")

    for name, want in ref["initial"].items():
        check(f"initial {name}", want, got["initial"][name])
    for step, (want_grads, have_grads) in enumerate(zip(ref["grads"], got["grads"], strict=True)):
        if want_grads.keys() != have_grads.keys():
            out.append(f"{case.name}: step {step}: trained parameters differ: {sorted(want_grads)} vs {sorted(have_grads)}")
            continue
        for name, want in want_grads.items():
            check(f"step {step} grad {name}", want, have_grads[name])
    for step, (want_params, have_params) in enumerate(zip(ref["params"], got["params"], strict=True)):
        for name, want in want_params.items():
            # Compare what the steps changed: the update is where a gradient error shows.
            initial = ref["initial"][name]
            check(f"step {step} update of {name}", want - initial, have_params[name] - initial)
    return out


def check_zero_not_vacuous(case: ZeroCase, ref: dict) -> None:
    assert ref["grads"] and all(g.abs().max() > 0 for step in ref["grads"] for g in step.values()), case.name
    trained = ref["grads"][0].keys()
    assert all((ref["params"][-1][n] != ref["initial"][n]).any() for n in trained), case.name


def check_zero_tiled_ran(case: ZeroCase, rank: int, tiled: dict) -> None:
    assert tiled["strategies"] == {"deepspeed_zero"}, (case.name, tiled["strategies"])
    want_path = "generic" if case.lora else case.path
    assert tiled["paths"] == {want_path}, (case.name, tiled["paths"])
    want_shards = case.expected_shards(rank)
    assert all(shards == [want_shards] * 2 for shards in tiled["shards"]), (case.name, rank, tiled["shards"])


def run_zero_group(tmp_path, cases, kinds=("untiled", "tiled"), catch=()):
    return run_distributed(train_zero_cases, WORLD, tmp_path, list(cases), kinds, catch, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_tiled_matches_untiled_under_zero(group, tmp_path):
    results = run_zero_group(tmp_path, GROUPS[group])
    failures = []
    for rank, per_case in enumerate(results):
        for name, runs in per_case.items():
            case = CASES[name]
            check_zero_not_vacuous(case, runs["untiled"])
            check_zero_tiled_ran(case, rank, runs["tiled"])
            failures += [f"rank {rank}: {line}" for line in zero_mismatches(case, runs["untiled"], runs["tiled"])]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(240)
def test_deepspeed_tiled_mlp_as_peer(tmp_path, record_property):
    """Ours and DeepSpeed's TiledMLP on the same cases. Ours must match the untiled run; the peer's
    outcome is recorded (``record_property``, printed) and never fails this test."""
    try:
        results = run_zero_group(tmp_path, PEER_CASES, kinds=("untiled", "tiled", "peer"), catch=("peer",))
    except TimeoutError as exc:  # only the peer can hang here: ours is proven in the test above
        record_property("peer", f"hung: {exc}")
        pytest.xfail(f"DeepSpeed's TiledMLP hung: {exc}")
    cases = {case.name: case for case in PEER_CASES}
    report, failures = [], []
    for name, runs in results[0].items():
        case = cases[name]
        check_zero_not_vacuous(case, runs["untiled"])
        failures += zero_mismatches(case, runs["untiled"], runs["tiled"])
        outcome = peer_outcome(case, runs["untiled"], runs["peer"])
        record_property(f"deepspeed_tiled_mlp[{name}]", outcome)
        report.append(f"{name}: DeepSpeed TiledMLP {outcome}")
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def peer_outcome(case: ZeroCase, ref: dict, peer: dict) -> str:
    if "error" in peer:
        return "raised " + peer["error"].strip().splitlines()[-1]
    wrong = zero_mismatches(case, ref, peer)
    if not wrong:
        return "agrees with the untiled run"
    return f"differs from the untiled run in {len(wrong)} checks, first: {wrong[0]}"


@pytest.mark.timeout(60)
def test_deepspeed_is_imported_only_for_zero3_parameters():
    # deepspeed stays an optional extra: importing tiled_mlp, resolving a plain module and entering
    # the strategy's context on it must not import it.
    code = (
        "import sys, torch, tiled_mlp\n"
        "from tiled_mlp.strategies import DeepSpeedZeroStrategy, resolve_strategy\n"
        "m = torch.nn.Linear(2, 2)\n"
        "assert not DeepSpeedZeroStrategy.claims(m)\n"
        "assert resolve_strategy(m).name == 'single_device'\n"
        "with DeepSpeedZeroStrategy().gathered(m): pass\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
