"""A DCP checkpoint (model + optimizer state) saved from an untiled FSDP2 run resumes in a tiled run,
and the other way round, with the same losses and parameters as the run that never stopped.

Two gloo processes on CPU, fp32, the toy model with each block and the root under ``fully_shard``,
AdamW. DCP's ``get_optimizer_state_dict`` is keyed by parameter FQNs (``named_parameters``), so
tiling must leave them exactly as they were: a TiledMLP that holds the MLP as a child adds
``.mlp.`` to every name below it and the optimizer state no longer lines up.
Two spawns: one saves both checkpoints and records the continuations, one resumes both.
"""
from __future__ import annotations

import pytest
import torch

from .dcp_resume import CONTINUE, KINDS, resume_runs, save_runs
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2
# Each spawn takes ~5 s to start; the work itself is a few tiny steps.
SPAWN_TIMEOUT = 60
TEST_TIMEOUT = 150  # covers the module fixture's spawn too (pytest-timeout counts setup)
# fp32: tiled and untiled differ only in per-shard GEMM rounding. Measured: losses 1.2e-7, final
# parameters 1.1e-7 (max |diff| / max |ref| per tensor) resumed vs uninterrupted; ~90x margin.
RTOL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    ranks = run_distributed(save_runs, WORLD, root, str(root / "ckpt"), timeout=SPAWN_TIMEOUT)
    return root, ranks


def rel(want: torch.Tensor, have: torch.Tensor) -> float:
    want, have = want.double(), have.double()
    return ((have - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def assert_params_close(want: dict, have: dict, what: str, rtol: float) -> None:
    assert list(have) == list(want), f"{what}: parameter names differ"
    bad = {n: rel(want[n], have[n]) for n in want if not rel(want[n], have[n]) <= rtol}
    assert not bad, f"{what}: relative error above {rtol}: {bad}"


@pytest.mark.timeout(TEST_TIMEOUT)
def test_names_do_not_depend_on_tiling(saved):
    """The keys a checkpoint is made of are the untiled model's, also for the optimizer."""
    _, ranks = saved
    for rank, record in enumerate(ranks):
        untiled, tiled = record["untiled"], record["tiled"]
        # Guards against a vacuous pass: the tiled run really has TiledMLPs, the untiled none.
        assert (untiled["tiled_modules"], tiled["tiled_modules"]) == (0, 2)
        # Optimizer state first: that is what DCP keys by parameter FQN. All differences are
        # collected, so the message also says which names did match.
        differ = []
        for key in ("optim_state", "optim_groups", "parameters", "modules", "model_keys"):
            if untiled[key] != tiled[key]:
                only_untiled = sorted(set(map(str, untiled[key])) - set(map(str, tiled[key])))
                only_tiled = sorted(set(map(str, tiled[key])) - set(map(str, untiled[key])))
                differ.append(f"{key}: untiled only {only_untiled}, tiled only {only_tiled}")
        assert not differ, f"rank {rank}: names differ between untiled and tiled:\n" + "\n".join(differ)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_resume_across_tiling(saved):
    """Untiled checkpoint -> tiled run, and tiled -> untiled: the run goes on as if never stopped."""
    root, saved_ranks = saved
    resumed_ranks = run_distributed(resume_runs, WORLD, root, str(root / "ckpt"), timeout=SPAWN_TIMEOUT)
    for rank, (before, after) in enumerate(zip(saved_ranks, resumed_ranks, strict=True)):
        for kind in KINDS:
            ref, run = before[kind], after[kind]
            what = f"rank {rank}: {kind} checkpoint resumed {'un' if kind == 'tiled' else ''}tiled"
            assert run["tiled_modules"] == (2 if kind == "untiled" else 0), what
            # The load itself: every parameter and every AdamW state tensor (and step) bit-exact.
            # The resumed model starts from another seed, so a tensor the load skipped would differ.
            assert_params_close(ref["saved_params"], run["loaded_params"], f"{what}: loaded parameters", 0.0)
            assert list(run["loaded_optim"]) == list(ref["saved_optim"]), f"{what}: optimizer state keys"
            for fqn, state in ref["saved_optim"].items():
                for k, v in state.items():
                    assert torch.equal(run["loaded_optim"][fqn][k], v), f"{what}: optimizer {fqn} {k}"
            # Training on: the same losses and final parameters as the uninterrupted run.
            assert len(run["losses"]) == CONTINUE
            assert run["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0), f"{what}: losses"
            assert_params_close(ref["final"], run["final"], f"{what}: final parameters", RTOL)
