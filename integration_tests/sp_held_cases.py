"""Rank body of ``test_sp_held_attention``: a second model's SP while an earlier stack holds transformers'
attention entry, after a forward of the earlier stack failed."""
from __future__ import annotations

from typing import Dict

import torch

from .sp_cases import raised
from .tiny_models import tiny_model


def second_apply_while_held(rank: int, world_size: int) -> Dict:
    from tiled_mlp.integrations import apply_long_context, is_tiled
    from tiled_mlp.integrations.seams import transformers_internals

    functions = transformers_internals.attention_functions()
    out: Dict = {}
    first = tiny_model("llama", seed=0, dtype=torch.float32)
    first.set_attn_implementation("sdpa")
    stack = apply_long_context(first, sequence_parallel=2, checkpoint_offload=False)
    # A forward that fails inside the stack (two samples where it was built for one): the stack stays applied.
    ids = torch.randint(0, 32, (2, 8))
    out["forward"] = raised(lambda: first(input_ids=ids, position_ids=torch.arange(8).expand(2, 8)))
    held = functions["sdpa"]
    # Mistral: windowed, the model the earlier message mistook the held entry for a user's attention with.
    second = tiny_model("mistral", seed=1, dtype=torch.float32)
    second.set_attn_implementation("sdpa")
    out["second"] = raised(lambda: apply_long_context(second, sequence_parallel=2, checkpoint_offload=False))
    out["second_untouched"] = not is_tiled(second) and functions["sdpa"] is held
    stack.remove()
    again = apply_long_context(second, sequence_parallel=2, checkpoint_offload=False)
    sp = again.sequence_parallel
    batch = sp.shard({"input_ids": torch.randint(0, 32, (1, 16)), "labels": torch.randint(0, 32, (1, 16))})
    out["second_loss_finite"] = bool(torch.isfinite(second(**batch).loss))
    again.remove()
    return out
