"""transformers' attention registry is process-wide: while an SP stack holds its entry (applied, not
removed, a failed forward included), a second apply says so and names ``.remove()``; after it, the second
model's stack applies and trains."""
from __future__ import annotations

import pytest

from .comparison import needs_deepspeed
from .sp_held_cases import second_apply_while_held
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, needs_deepspeed]


@pytest.mark.timeout(90)
def test_a_second_apply_while_an_earlier_stack_holds_the_attention_names_it_and_remove(tmp_path):
    for rank, out in enumerate(run_distributed(second_apply_while_held, 2, tmp_path, timeout=80)):
        assert out["forward"][0] == "ValueError" and "micro batches of 1" in out["forward"][1], (rank, out["forward"])
        kind, message = out["second"]
        assert kind == "RuntimeError", (rank, out["second"])
        for words in ("transformers' attention under 'sdpa' is held, process-wide, by an earlier Ulysses SP stack",
                      "on LlamaForCausalLM", "call .remove() on the earlier handle"):
            assert words in message, (rank, words, message)
        assert out["second_untouched"], rank
        assert out["second_loss_finite"], rank
