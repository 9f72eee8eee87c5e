"""Ulysses SP (2 gloo processes) against one process on the full sequence, where the attention is more
than causal order: sliding windows (Mistral, Qwen2's sliding layers, Gemma 3's sliding layers, Phi-3), a
left-padding ``attention_mask`` (one case with a rank whose slice is all padding, one under HF's
checkpointing, whose recompute runs the attention again). DeepSpeed's wrapper drops the mask that
carries both under sdpa; each must match
the reference in float64: the loss and every full gradient within ``BOUND`` (1e-12) relative.

Without the whole-sequence masks (``ulysses_masks``) the losses are off by 2e-3 to 4e-2 and the worst
gradients by 90% to 160%.
"""
from __future__ import annotations

import pytest

from .comparison import BOUND, needs_deepspeed, rel_error
from .sp_mask_cases import CASES, PACKED_CASES, mask_reference, run_mask_cases
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's

WINDOWS = [c for c in CASES if c.left_padding == 0 and c.positions == "arange"]
MASKED = [c for c in CASES if c not in WINDOWS]


def check(cases, results) -> None:
    failures, worst = [], []
    for case in cases:
        ref = mask_reference(case)
        assert all(g.abs().max() > 0 for g in ref["grads"].values()), case.name
        case_worst = 0.0
        for rank, per_rank in enumerate(results):
            have = per_rank[case.name]
            errs = {"loss": rel_error(ref["loss"], have["loss"]),
                    **{f"grad {n}": rel_error(g, have["grads"][n]) for n, g in ref["grads"].items()}}
            failures += [f"{case.name}: rank {rank}: {what}: relative error {err:.3g} > {BOUND:g}"
                         for what, err in errs.items() if not err <= BOUND]
            case_worst = max(case_worst, *errs.values())
        worst.append(f"{case.name} {case_worst:.2e}")
    print("worst relative error per case: " + ", ".join(worst))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(60)
def test_sp2_sliding_windows_match_one_process(tmp_path):
    check(WINDOWS, run_distributed(run_mask_cases, 2, tmp_path, WINDOWS, timeout=50))


@pytest.mark.timeout(60)
def test_sp2_left_padding_matches_one_process(tmp_path):
    check(MASKED, run_distributed(run_mask_cases, 2, tmp_path, MASKED, timeout=50))


@pytest.mark.timeout(60)
def test_sp2_packed_samples_match_one_process_with_and_without_cache(tmp_path):
    """HF tells packed documents apart when its decoder holds no cache (checkpointing, use_cache=False) and
    not with one (use_cache=True); SP must do what the same call does in one process."""
    check(PACKED_CASES, run_distributed(run_mask_cases, 2, tmp_path, PACKED_CASES, timeout=50))


@pytest.mark.timeout(60)
def test_sp2_refuses_masks_it_cannot_honour(tmp_path):
    from .sp_mask_cases import mask_refusals

    expected = {
        "flex_window": ("ValueError", "without this model's sliding window (4 tokens)"),
        "four_d_mask": ("ValueError", "attention_mask must be the 2-D padding mask"),
        "one_rank_mask": ("ValueError", "some ranks of the SP group passed an attention_mask and some did not"),
        "flash_padding": ("ValueError", "a padding attention_mask cannot be applied"),
    }
    for rank, out in enumerate(run_distributed(mask_refusals, 2, tmp_path, timeout=50)):
        for what, (kind, words) in expected.items():
            assert out[what][0] == kind and words in out[what][1], (rank, what, out[what])
        assert out["after"][0] == "", (rank, out["after"])
