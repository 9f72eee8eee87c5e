"""``tiled_cross_entropy`` under DDP, FSDP2 and DeepSpeed ZeRO 1, 2 and 3: two gloo processes on CPU.

The loss is computed inside a tiny LM's forward (``loss_cases.TinyLM``), tied and untied, with 9 and 23
tokens on the two ranks, uneven ignore masks, ``num_items_in_batch`` = the global count of valid labels
(all-reduced), and in one variant a rank with no valid label at all (its loss must be exactly 0, not
NaN, and the ranks must not hang; the ranks also run 3 and 5 shards there). Each rank back-propagates
``world * loss``: the backends average gradients over ranks, so the averaged gradient is the global
loss's (see ``loss_cases``). Two SGD steps per case.

Against a single-process, untiled float64 reference on the same data, within ``BOUND`` = 1e-12 under DDP
and FSDP2 (float64 models), ``ZERO_BOUND`` under DeepSpeed, whose engines train the float32 model
(``comparison.ZERO_DTYPE``: ZeRO-3 takes no float64 parameters) (max |diff| / max |reference| per tensor):
- the loss: the sum over ranks of each rank's loss, every step;
- every parameter's full gradient after the backend's reduction (the head's, the embedding's, tied or
  not, the MLP's and the norm's), every step, on both ranks;
- every parameter after every SGD step.
Also: each forward made one tiled call over all the rank's tokens in the case's shard count, resolved
to the backend's strategy; under ZeRO-3 the head's weight was gathered by lm_head's own hooks when the
call began, and the strategy gathered nothing itself (never per shard). An untiled case per
backend runs the same harness around the plain loss and is held to the same bound.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from .comparison import BOUND, ZERO_BOUND, ZERO_DTYPE, needs_deepspeed, rel_error
from .loss_cases import DTYPE, STEPS, TOKENS, LossCase, loss_cases_for, loss_global_count, loss_reference_run
from .spawn import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 2

GROUPS = {
    "ddp": loss_cases_for("ddp"),
    "fsdp2": loss_cases_for("fsdp2"),
    "zero1": loss_cases_for("zero1", untiled_harness=False),
    "zero2": loss_cases_for("zero2", untiled_harness=False),
    # ZeRO-3 in two runs, tied and untied: one failing case stops its run (an exception in a rank).
    "zero3-tied": loss_cases_for("zero3", tied=(True,)),
    "zero3-untied": loss_cases_for("zero3", tied=(False,)),
}
# (pytest timeout, run_distributed timeout) in seconds. Measured on 2 busy cores: DDP/FSDP2 runs 10-35 s,
# DeepSpeed runs 25-45 s (import, one engine per case; its shared-memory op is built once per test run,
# ~40 s, in the TORCH_EXTENSIONS_DIR that conftest.py shares).
TIMEOUTS = {"torch": (180, 150), "deepspeed": (300, 240)}


def result_dtype(case: LossCase) -> torch.dtype:
    """DeepSpeed's engines here train the float32 model: full gradients and parameters come back in float32."""
    return torch.float32 if case.zero_stage else DTYPE


def loss_bound(case: LossCase, what: str, step: int) -> float:
    return BOUND if case.zero_stage is None else ZERO_BOUND


def loss_errors(case: LossCase, ref: Dict, ranks: List[Dict]) -> Dict[str, tuple]:
    """``{what: (relative error, bound)}`` for everything compared."""
    out = {}
    for step in range(STEPS):
        out[f"step {step} loss"] = (rel_error(ref["losses"][step], sum(r["losses"][step] for r in ranks)),
                                    loss_bound(case, "loss", step))
        for what in ("grads", "params"):
            for rank, r in enumerate(ranks):
                want, have = ref[what][step], r[what][step]
                assert want.keys() == have.keys(), (case.name, what, sorted(want), sorted(have))
                for name, w in want.items():
                    assert have[name].dtype == result_dtype(case), (case.name, step, rank, what, name, have[name].dtype)
                    out[f"step {step} rank {rank} {what[:-1]} {name}"] = (rel_error(w, have[name]),
                                                                         loss_bound(case, what, step))
    return out


def check_calls(case: LossCase, rank: int, record: Dict, strategy: bool = True) -> List[str]:
    """Each forward made exactly one tiled call (none untiled), over all this rank's tokens in the
    case's shard count, resolved to the backend's strategy (checked where ``strategy``)."""
    keys = ("strategy", "tokens", "shards") if strategy else ("tokens", "shards")
    want = [{"strategy": case.expected_strategy, "tokens": TOKENS[rank], "shards": case.shards(rank)}] if case.tiled else []
    want = [{k: c[k] for k in keys} for c in want]
    return [f"{case.name}: rank {rank} step {step}: tiled calls {calls}, expected {want}"
            for step, calls in enumerate(record["calls"]) if [{k: c.get(k) for k in keys} for c in calls] != want]


def check_zero3_gathers(case: LossCase, rank: int, record: Dict) -> List[str]:
    """The loss runs inside lm_head's own call, so ZeRO-3's hooks on lm_head have gathered its weight when
    the call enters the strategy's region (status AVAILABLE, once per forward), and the strategy gathers
    nothing itself: no ``GatheredParameters`` region and no ``all_gather`` of the weight, in forward or in
    backward (where lm_head's pre-backward hook gathers it again for autograd to accumulate its whole
    gradient). ZeRO's own fetches go through its coordinator's coalesced gather, not counted here."""
    out = []
    idle = {"regions": 0, "all_gathers": 0, "status_at_call": []}
    for step, gathers in enumerate(record["gathers"]):
        if gathers != {"forward": dict(idle, status_at_call=["AVAILABLE"]), "backward": idle}:
            out.append(f"{case.name}: rank {rank} step {step}: gathers of the head's weight {gathers}")
    return out


def check_loss_not_vacuous(case: LossCase, ref: Dict) -> None:
    for step in range(STEPS):
        assert ref["losses"][step] > 0 and torch.isfinite(ref["losses"][step]), case.name
        assert all(g.abs().max() > 0 for g in ref["grads"][step].values()), case.name
    # Every SGD step moved every parameter (each step is recorded by the one helper the ranks use too).
    assert all((ref["params"][1][n] != w).any() for n, w in ref["params"][0].items()), case.name
    assert case.tied == ("lm_head.weight" not in ref["grads"][0]), case.name  # tied: one parameter


def check_loss_group(group: str, results: List[Dict[str, Dict]], strategy: bool = True) -> List[str]:
    failures, worst = [], []
    for case in GROUPS[group]:
        ranks = [per_rank[case.name] for per_rank in results]
        ref = loss_reference_run(case, WORLD)
        check_loss_not_vacuous(case, ref)
        for rank, record in enumerate(ranks):
            assert record["counts"] == ref["counts"] == [loss_global_count(case, s, WORLD) for s in range(STEPS)]
            assert all(torch.equal(record["initial"][n], p) for n, p in make_initial(case).items()), case.name
            failures += check_calls(case, rank, record, strategy)
            if case.zero_stage == 3 and case.tiled:
                failures += check_zero3_gathers(case, rank, record)
        if case.empty_rank:
            # No valid label on rank 0: its share of the loss is exactly 0 (not NaN), every step.
            if not all(loss.item() == 0.0 for loss in ranks[0]["losses"]):
                failures.append(f"{case.name}: the empty rank's losses are {ranks[0]['losses']}, not 0")
        errs = loss_errors(case, ref, ranks)
        failures += [f"{case.name}: {what}: relative error {err:.3g} > {limit:g}"
                     for what, (err, limit) in errs.items() if not err <= limit]
        worst.append(f"{case.name} {max(err for err, _ in errs.values()):.2e}")
    print(f"{group}: worst relative error per case: " + ", ".join(worst))
    if group.startswith("zero3"):
        for case in GROUPS[group]:
            print(f"{case.name}: gathers of the head's weight per step, rank 0: {results[0][case.name]['gathers']}")
    return failures


def make_initial(case: LossCase) -> Dict[str, torch.Tensor]:
    from .loss_cases import loss_model

    dtype = ZERO_DTYPE if case.zero_stage else DTYPE
    return {n: p.detach() for n, p in loss_model(case.tied, dtype=dtype).named_parameters()}


def run_loss_group(group: str, tmp_path) -> List[Dict[str, Dict]]:
    from .loss_cases import run_loss_cases

    timeout = TIMEOUTS["deepspeed" if group.startswith("zero") else "torch"][1]
    return run_distributed(run_loss_cases, WORLD, tmp_path, list(GROUPS[group]), timeout=timeout)


@pytest.fixture(scope="module")
def fsdp2_results(tmp_path_factory):
    return run_loss_group("fsdp2", tmp_path_factory.mktemp("fsdp2-loss"))


@pytest.mark.timeout(TIMEOUTS["torch"][0])
def test_tiled_loss_under_ddp(tmp_path):
    failures = check_loss_group("ddp", run_loss_group("ddp", tmp_path))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(TIMEOUTS["torch"][0])
def test_tiled_loss_under_fsdp2(fsdp2_results):
    """fully_shard(model.layer), then fully_shard(model): the head (and the embedding) in the root's
    group, the loss computed inside the root's forward. The strategy's name is checked below."""
    failures = check_loss_group("fsdp2", fsdp2_results, strategy=False)
    for rank, per_case in enumerate(fsdp2_results):
        for case in GROUPS["fsdp2"]:
            message = per_case[case.name]["outside_forward"]
            # Outside the root unit's forward the head's parameters are sharded DTensors: refused.
            if not (message is not None and "sharded DTensors" in message and "FSDP2" in message):
                failures.append(f"{case.name}: rank {rank}: outside the root's forward: {message!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(TIMEOUTS["torch"][0])
def test_the_head_resolves_the_fsdp2_strategy_tied_or_not(fsdp2_results):
    """The head's parameters are managed by the root's FSDP2 group whether or not the weight is shared
    with the embedding: the call must resolve the fsdp2 strategy in both cases."""
    failures = []
    for case in GROUPS["fsdp2"]:
        for rank, per_case in enumerate(fsdp2_results):
            record = per_case[case.name]
            failures += check_calls(case, rank, record)
    assert not failures, "\n".join(failures)


@needs_deepspeed
@pytest.mark.timeout(TIMEOUTS["deepspeed"][0])
@pytest.mark.parametrize("group", ["zero1", "zero2", "zero3-tied", "zero3-untied"])
def test_tiled_loss_under_deepspeed_zero(group, tmp_path):
    failures = check_loss_group(group, run_loss_group(group, tmp_path))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(60)
def test_the_reference_is_hugging_faces_causal_lm_loss():
    """The float64 reference (``loss_cases.case_reference_loss``) is ``ForCausalLMLoss`` with
    ``num_items_in_batch``, up to ForCausalLMLoss's float32 upcast (``logits.float()``)."""
    transformers_loss = pytest.importorskip("transformers.loss.loss_utils")
    from .loss_cases import VOCAB, case_reference_loss, loss_batch

    case = LossCase("reference", "ddp", tied=False)
    count = loss_global_count(case, 0, WORLD)
    for rank in range(WORLD):
        ids, labels = loss_batch(case, 0, rank)
        logits = torch.randn(*ids.shape, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        want = transformers_loss.ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(count))
        have = case_reference_loss(logits, labels, torch.tensor(count))
        assert want.dtype == torch.float32 and have.dtype == torch.float64
        assert abs(have.item() - want.item()) <= 1e-6 * abs(want.item())
