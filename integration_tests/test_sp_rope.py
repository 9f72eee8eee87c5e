"""Ulysses SP=2 (``apply_long_context(model, sequence_parallel=2)``, sdpa, float64) with a RoPE whose
frequencies follow the sequence's length, against one process without SP: Llama with ``rope_type
"dynamic"`` (factor 2, trained length 16) and Phi-3 with ``longrope`` (the Phi-3-128k / Phi-3.5 style),
a plain-RoPE Llama as the control. Calls at 32, 24, 8 and 40 tokens in turn, on the same weights: the
dynamic type grows, keeps and resets its frequencies between them, as Hugging Face's code does in one
process. Gemma 3 (one rotary embedding, a rope_type per layer type: dynamic on its full-attention layer)
too; its RMSNorms take the weight in float32 (``1 + weight.float()``), so their weights' gradients are
float32 sums over the tokens, summed per rank under SP: those are held to ``FLOAT32_NORMS`` (measured
2e-7), every other loss and gradient to ``BOUND``.

Without the whole sequence's length (each rank picking from its slice), the dynamic Llama's loss was off
by 1e-6 and a gradient by 19%, Phi-3's by 3e-5 and 2.8%; with it, every loss and gradient is within
``BOUND`` (measured worst: a few 1e-16)."""
from __future__ import annotations

import pytest

from .comparison import BOUND, needs_deepspeed, rel_error
from .sp_rope_cases import LENGTHS, MODELS, rope_reference, run_ranks
from .spawn import run_distributed

FLOAT32_NORMS = 1e-6

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]  # Ulysses SP is DeepSpeed's


def bound_of(model: str, what: str) -> float:
    return FLOAT32_NORMS if model.startswith("gemma") and "norm" in what else BOUND


@pytest.mark.timeout(120)
def test_length_dependent_rope_under_sp2_matches_one_process(tmp_path):
    ranks = run_distributed(run_ranks, 2, tmp_path, timeout=100)
    failures, worst = [], {}
    for name in MODELS:
        ref = rope_reference(name)
        worst[name] = 0.0
        for rank, per_model in enumerate(ranks):
            for call, (want, have) in enumerate(zip(ref, per_model[name], strict=True)):
                errs = {"loss": rel_error(want["loss"], have["loss"])}
                errs.update({n: rel_error(g, have["grads"][n]) for n, g in want["grads"].items()})
                worst[name] = max(worst[name], *(e for w, e in errs.items() if bound_of(name, w) == BOUND))
                failures += [f"{name}: rank {rank}: {LENGTHS[call]} tokens: {what}: relative error {e:.3g} > "
                             f"{bound_of(name, what):g}" for what, e in errs.items() if not e <= bound_of(name, what)]
    print("worst relative error per model (held to BOUND):", {k: f"{v:.2e}" for k, v in worst.items()})
    assert not failures, "\n".join(failures)
