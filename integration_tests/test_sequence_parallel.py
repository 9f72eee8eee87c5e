"""Ulysses sequence parallelism (``apply_sequence_parallel``, DeepSpeed's ``UlyssesSPAttentionHF``) with the
tiled MLP and the tiled loss, on gloo CPU processes: SP=2 on 2 processes, SP=2 x DP=2 on 4.

Every case trains a tiny Llama or Qwen2 (float64, float32 under DeepSpeed; 2 query heads, 1 key/value head) for 2 SGD steps, each
rank on its slice of its DP group's sample, and is compared with one process training the same model
untiled, unoffloaded, without SP, on the full samples, with Hugging Face's own loss in float64
(``sp_cases.reference_run``): every rank's loss at every step, every full gradient at every step and
every full parameter after every step. Masks differ across the SP ranks (one rank's slice mostly
ignored, or with no valid label at all), with and without ``num_items_in_batch``; the SP ranks also tile
their MLPs and losses in different shard counts. Bounds (max |diff| / max |reference|, per tensor):

- ``BOUND`` = 1e-12 for float64 end to end (torch all-reduce, DDP, FSDP2). Measured worst 1.3e-15. It
  holds only against an sdpa reference: eager attention takes its softmax in float32 (2e-8 off here),
  whereas sdpa on the full sequence and on each rank's heads after the all-to-all is float64 throughout.
- ``ZERO_BOUND`` under DeepSpeed, whose engines train the float32 model (``comparison.ZERO_DTYPE``: ZeRO-3
  takes no float64 parameters) against the float64 reference; under SP DeepSpeed also reduces the gradients
  in float32 (``seq_parallel_communication_data_type``). Measured worst 1.3e-6 (ZeRO-2, Qwen2, a step-1
  gradient); 8.6e-7 for Llama. Hugging Face's own loss (``trainer-hf``) takes float32 logits: ``ZERO_BOUND``
  throughout.

A wrong scale (a mean per rank, the local count, a backward that does not sum over the group, a rank's
share dropped) is off by 1e-3 to 1 here.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from .comparison import BOUND, ZERO_BOUND, needs_deepspeed, rel_error
from .sp_cases import (
    GROUPS,
    LOSS_SHARDS,
    MLP_SHARDS,
    STEPS,
    TOKENS,
    SPCase,
    rank_targets,
    reference_step,
    sp_reference_run,
    sp_sample,
)
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's

LAYERS, HIDDEN = 2, 16  # tiny_models


def offloaded_bytes(case: SPCase) -> int:
    """Checkpoint offload: the input of every checkpointed layer but the last, this rank's slice."""
    return (LAYERS - 1) * 1 * (TOKENS // 2) * HIDDEN * torch.finfo(case.dtype).bits // 8


def sp_bound(case: SPCase, what: str, step: int) -> float:
    if case.loss_path == "trainer-hf":
        return ZERO_BOUND  # Hugging Face's own loss takes float32 logits (``logits.float()``)
    if not case.backend.startswith("zero"):
        return BOUND
    return ZERO_BOUND


def sp_errors(case: SPCase, ref: Dict, rank: int, record: Dict) -> Dict[str, tuple]:
    """``{what: (relative error, bound)}``."""
    out = {}
    group = rank // case.sp
    for name, want in ref["initial"].items():
        out[f"initial {name}"] = (rel_error(want, record["initial"][name]), sp_bound(case, "param", 0))
    for step in range(STEPS):
        out[f"step {step} loss"] = (rel_error(ref["losses"][step][group], record["losses"][step]), sp_bound(case, "loss", step))
        assert ref["grads"][step].keys() == record["grads"][step].keys(), case.name
        for name, want in ref["grads"][step].items():
            out[f"step {step} grad {name}"] = (rel_error(want, record["grads"][step][name]), sp_bound(case, "grad", step))
        for name, want in ref["params"][step].items():
            out[f"step {step} param {name}"] = (rel_error(want, record["params"][step][name]), sp_bound(case, "param", step))
    return out


def check_sp_not_vacuous(case: SPCase, ref: Dict) -> None:
    for step in range(STEPS):
        assert all(torch.isfinite(loss) and loss > 0 for loss in ref["losses"][step]), case.name
        assert all(g.abs().max() > 0 for g in ref["grads"][step].values()), case.name
    assert all((ref["params"][-1][n] != p).any() for n, p in ref["initial"].items()), case.name


def check_masks(case: SPCase, ranks: List[Dict]) -> List[str]:
    """Each rank saw its slice's valid targets, and the masks really are uneven across the SP ranks."""
    failures = []
    for rank, record in enumerate(ranks):
        want = [rank_targets(case, step, rank) for step in range(STEPS)]
        if record["targets"] != want:
            failures.append(f"{case.name}: rank {rank}: valid targets {record['targets']}, expected {want}")
    for step in range(STEPS):
        counts = [record["targets"][step] for record in ranks[:case.sp]]
        uneven = {"plain": True, "uneven": max(counts) >= 5 * max(1, min(counts)), "empty": min(counts) == 0}
        if not uneven[case.masks]:
            failures.append(f"{case.name}: step {step}: SP ranks' valid targets {counts} are not {case.masks!r}")
    return failures


def check_offload(case: SPCase, rank: int, record: Dict) -> List[str]:
    """With checkpoint offload on, every step: after the forward the host holds exactly the offloaded
    layer inputs of this rank's slice, never more, and after the backward nothing (the copies go with
    the graph)."""
    held = offloaded_bytes(case)
    want = [(held, held, 0)] * STEPS if case.offload else []
    if record["host_bytes"] != want:
        return [f"{case.name}: rank {rank}: host bytes (after forward, peak, after backward) per step "
                f"{record['host_bytes']}, "
                f"expected {want}"]
    return []


def check_tiled_calls(case: SPCase, rank: int, record: Dict) -> List[str]:
    """Every step, both MLPs tiled this rank's slice in its own shard count (``MLP_SHARDS``) and the loss
    made one tiled call over it (``LOSS_SHARDS``), each resolved to the backend's strategy; HF's own loss
    (``trainer-hf``) tiles nothing."""
    strategy = {"allreduce": "single_device", "ddp": "ddp", "fsdp2": "fsdp2"}.get(case.backend, "deepspeed_zero")
    sp_rank = rank % case.sp
    tiled = case.loss_path != "trainer-hf"
    want = {"shards": [[MLP_SHARDS[sp_rank]] * LAYERS if tiled else []] * STEPS,
            "paths": {"fast"} if tiled else set(), "strategies": {strategy} if tiled else set(),
            "loss_calls": [[{"strategy": strategy, "tokens": TOKENS // case.sp, "shards": LOSS_SHARDS[sp_rank]}]
                           if tiled else []] * STEPS}
    have = {key: record[key] for key in want}
    return [] if have == want else [f"{case.name}: rank {rank}: tiled calls {have}, expected {want}"]


def check_cases(cases, results: List[Dict[str, Dict]]) -> List[str]:
    """Every way the ranks' runs of ``cases`` differ from the reference (and the worst errors, printed)."""
    failures, worst = [], []
    for case in cases:
        ranks = [per_rank[case.name] for per_rank in results]
        ref = sp_reference_run(case)
        check_sp_not_vacuous(case, ref)
        failures += check_masks(case, ranks)
        case_worst = 0.0
        for rank, record in enumerate(ranks):
            failures += check_offload(case, rank, record)
            failures += check_tiled_calls(case, rank, record)
            if case.loader and not all(record["loader_batches"]):
                failures.append(f"{case.name}: rank {rank}: the data loader's batches differ from shard()'s: "
                                f"{record['loader_batches']}")
            errs = sp_errors(case, ref, rank, record)
            failures += [f"{case.name}: rank {rank}: {what}: relative error {err:.3g} > {limit:g}"
                         for what, (err, limit) in errs.items() if not err <= limit]
            case_worst = max(case_worst, *(err for err, _ in errs.values()))
        worst.append(f"{case.name} {case_worst:.2e}")
    print("worst relative error per case: " + ", ".join(worst))
    return failures


def run_sp_group(group: str, tmp_path, timeout: float) -> List[Dict[str, Dict]]:
    from .sp_cases import run_sp_cases

    world = GROUPS[group][0].world
    assert all(case.world == world for case in GROUPS[group])
    return run_distributed(run_sp_cases, world, tmp_path, list(GROUPS[group]), timeout=timeout)


# -- SP=2, tiled MLP + tiled loss, Llama and Qwen2, uneven masks, num_items_in_batch -------------------
@pytest.mark.timeout(150)
def test_sp2_matches_one_process_under_allreduce_and_ddp(tmp_path):
    """Torch all-reduce (averaged) and DDP: plain, uneven and empty-rank masks, with and without
    num_items_in_batch."""
    failures = check_cases(GROUPS["sp2-allreduce-ddp"], run_sp_group("sp2-allreduce-ddp", tmp_path, 120))
    assert not failures, "\n".join(failures)


# -- the same with HF checkpointing (non-reentrant) + checkpoint offload -----------------------------
@pytest.mark.timeout(150)
def test_sp2_with_checkpoint_offload(tmp_path):
    failures = check_cases(GROUPS["sp2-offload"], run_sp_group("sp2-offload", tmp_path, 120))
    assert not failures, "\n".join(failures)


# -- FSDP2 (fully_shard per decoder layer, then the root) + SP=2 ---------------------------------------
@pytest.mark.timeout(150)
def test_fsdp2_with_sp2(tmp_path):
    failures = check_cases(GROUPS["sp2-fsdp2"], run_sp_group("sp2-fsdp2", tmp_path, 120))
    assert not failures, "\n".join(failures)


# -- DeepSpeed ZeRO + SP (deepspeed.initialize(mpu=sp.mpu)) ------------------------------------------
@pytest.mark.timeout(180)
def test_zero3_with_sp2(tmp_path):
    """ZeRO-3 on the 2 SP ranks (DP=1), offload on and off. ZeRO-1 and ZeRO-2, which divide by the DP size
    only under SP (summing over the SP ranks), recognised and matching (ZeRO-3 without reduce-scatter and
    stage 0: ``test_sp_backends.py``)."""
    failures = check_cases(GROUPS["sp2-zero3"], run_sp_group("sp2-zero3", tmp_path, 150))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(180)
def test_zero3_with_sp2_times_dp2(tmp_path):
    """4 processes: SP groups {0, 1} and {2, 3}, each with its own samples; ZeRO-3 partitions over all 4.
    Uneven and empty-rank masks (the empty SP rank differs between the DP groups), num_items_in_batch
    over both DP groups (each rank back-propagates dp * loss), checkpoint offload. DDP on the same layout
    too."""
    failures = check_cases(GROUPS["sp2xdp2-zero3"], run_sp_group("sp2xdp2-zero3", tmp_path, 150))
    assert not failures, "\n".join(failures)


# -- DeepSpeed's data loader adapter ------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_data_loader_gives_the_batches_and_losses_of_shard(tmp_path):
    """sp.data_loader(DataLoader over full samples with position_ids): each rank's loader holds a
    different step's sample, the adapter hands them out in turn, split across the group. Every batch
    equals shard()'s, and the losses equal those of the same case fed by shard(), bit for bit."""
    from tiled_mlp.integrations.seams import deepspeed_internals
    from tiled_mlp.strategies import checked_versions

    if not deepspeed_internals.CHECKED.contains(str(checked_versions.installed("deepspeed"))):
        pytest.skip("DeepSpeed's Ulysses SP is refused on this release (tests/test_seams.py)")
    results = run_sp_group("sp2-loader", tmp_path, 120)
    failures = check_cases(GROUPS["sp2-loader"], results)
    for case in GROUPS["sp2-loader"]:
        if case.loader:
            twin = case.name.replace("-loader", "-shard")
            for rank, per_rank in enumerate(results):
                if not all(torch.equal(a, b) for a, b in zip(per_rank[case.name]["losses"], per_rank[twin]["losses"],
                                                             strict=True)):
                    failures.append(f"{case.name}: rank {rank}: losses {per_rank[case.name]['losses']} != shard()'s "
                                    f"{per_rank[twin]['losses']}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["zero1", "zero2"])
def test_deepspeed_sum_over_sp_is_read_from_deepspeed_not_the_head(tmp_path, backend):
    """A frozen lm_head carries no ZeRO attribute: ZeRO-1/2 still sum over the
    SP ranks there, and the loss must hand each rank 1, not the group size (which would double every gradient)."""
    from .sp_cases import frozen_head_grads

    case = SPCase("frozen-head", backend=backend, masks="uneven")
    ref = sp_reference_run(case)["grads"][0]
    for rank, grads in enumerate(run_distributed(frozen_head_grads, 2, tmp_path, backend, timeout=150)):
        assert grads and "lm_head.weight" not in grads
        errs = {n: rel_error(ref[n], g) for n, g in grads.items()}
        assert max(errs.values()) <= ZERO_BOUND, (rank, {k: v for k, v in errs.items() if v > ZERO_BOUND})


# -- the HF Trainer's loss under ParallelismConfig(sp_backend="deepspeed") ------------------------------
@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory):
    return run_sp_group("sp2-trainer", tmp_path_factory.mktemp("sp-trainer"), 120)


TRAINER = {case.name: case for case in GROUPS["sp2-trainer"]}


@pytest.mark.timeout(150)
def test_trainer_sp_loss_over_the_tiled_loss(trainer_results):
    """Not the Trainer itself (accelerate's DeepSpeed launch has no place in a 2-core CPU test), but the
    function its ``compute_loss`` calls under DeepSpeed SP, ``deepspeed_sp_compute_loss``, on the model
    DeepSpeed's SP and ZeRO-3 prepare: with the tiled loss installed *without* a sequence group it
    returns each rank's mean, which that function re-weights by the ranks' valid tokens (a differentiable
    all-gather): the whole sequence's loss and gradient, uneven masks, offload or not. HF's own loss on
    the same path with a rank that has no valid label checks the harness."""
    names = ["trainer-zero3-llama-uneven", "trainer-zero3-qwen2-uneven-offload", "trainer-hf-loss-zero3-llama-empty-rank"]
    failures = check_cases([TRAINER[name] for name in names], trainer_results)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(150)
def test_trainer_sp_loss_over_the_tiled_loss_with_an_empty_rank(trainer_results):
    """A rank with no valid label: its tiled mean is NaN (as F.cross_entropy's), masked out by the
    Trainer's re-weighting, and its gradients must be exact zeros, not NaN (the kernel must never compute 0 * 1/0)."""
    failures = check_cases([TRAINER["trainer-zero3-llama-empty-rank"]], trainer_results)
    assert not failures, "\n".join(failures[:5])


# -- refusals and remove() ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def error_outcomes(tmp_path_factory):
    from .sp_cases import error_paths

    return run_distributed(error_paths, 2, tmp_path_factory.mktemp("sp-errors"), timeout=100)


@pytest.mark.timeout(120)
def test_refusals(error_outcomes):
    for rank, out in enumerate(error_outcomes):
        expected = {
            "no_tiled_loss": ("ValueError", "has no tiled loss"),
            "query_heads": ("ValueError", "must divide the 1 query heads"),
            "kv_heads": ("ValueError", "multiple of the 3 key/value heads"),
            "size_3": ("ValueError", "does not divide into groups of 3"),
            "size_1": ("ValueError", "size must be an int >= 2"),
            "eager": ("ValueError", "eager attention needs a [tokens, tokens] mask"),
            "twice": ("RuntimeError", "is held, process-wide, by an earlier Ulysses SP stack"),
            "odd_length": ("ValueError", "15 tokens do not split across 2 ranks"),
            "no_input_ids": ("ValueError", "needs input_ids"),
            "moe": ("ValueError", "router auxiliary loss"),
            "odd_tensor": ("ValueError", "['attention_mask'] do not have 16"),
        }
        for what, (kind, words) in expected.items():
            got_kind, message = out[what]
            assert got_kind == kind and words in message, (rank, what, out[what])
        # DeepSpeed's wrapper is scoped to the SP model's attention: another sdpa model is unchanged.
        assert out["other_model_diff"] == 0.0, (rank, out["other_model_diff"])


@pytest.mark.timeout(120)
def test_a_refused_apply_leaves_nothing_behind(error_outcomes):
    """DeepSpeed creates its SP groups before refusing eager attention; the refusal must release them
    (or the next apply finds them "already exist") and leave the attention functions as they were."""
    for out in error_outcomes:
        assert out["after_eager"] == {"sdpa_is_original": True, "overrides_as_before": True, "groups_released": True,
                                      "loss_group": False, "kv_groups": [2, 2]}


@pytest.mark.timeout(120)
def test_remove_restores_attention_and_loss(error_outcomes):
    """After a forward and backward under SP, remove(): ALL_ATTENTION_FUNCTIONS as before (sdpa the
    library's function, no instance override left), DeepSpeed's groups released, the attention modules'
    num_key_value_groups back (DeepSpeed sets them to 1 in the forward), the loss without a group; a
    plain forward on the full sample then equals the reference. A second apply and remove work."""
    ids, labels = sp_sample(SPCase("remove"), 0, 0)
    ref = reference_step("llama", ids, labels)
    for rank, out in enumerate(error_outcomes):
        assert out["under_sp"] == {"sdpa_is_original": False, "overrides_as_before": False, "groups_released": False,
                                   "loss_group": True, "kv_groups": [1, 1]}, rank  # the checks below can fail
        restored = {"sdpa_is_original": True, "overrides_as_before": True, "groups_released": True,
                    "loss_group": False, "kv_groups": [2, 2]}
        assert out["after_remove"] == restored, rank
        assert out["after_second_remove"] == restored, rank
        assert out["eval_loss"] is not None and rel_error(ref["loss"], out["eval_loss"]) <= BOUND, (rank, out["eval_loss"])
        plain = out["plain_after_remove"]
        errs = {"loss": rel_error(ref["loss"], plain["loss"]),
                **{n: rel_error(g, plain["grads"][n]) for n, g in ref["grads"].items()}}
        assert max(errs.values()) <= BOUND, (rank, {k: v for k, v in errs.items() if v > BOUND})
