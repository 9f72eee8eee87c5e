"""A user's own function under an attention name (``ALL_ATTENTION_FUNCTIONS["sdpa"] = custom``) under
Ulysses SP: the rank-side run. The SP model's attention runs it after the all-to-all (on the whole
sequence), a model beside it without SP runs it as it would without SP, and ``remove()`` leaves it under
the name."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .sp_cases import raised
from .sp_mask_cases import TOKENS, MaskCase, build_mask_model, mask_sample


def user_override_kept(rank: int, world: int) -> Dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    calls: List[Tuple[int, int]] = []  # (id of the attention module, tokens its query covers)

    def custom(module, query, key, value, attention_mask, **kwargs):
        calls.append((id(module), query.shape[2]))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = custom
    try:
        model, other = build_mask_model("llama"), build_mask_model("llama")
        apply_tiled_mlp(model, loss=True)
        sp = apply_sequence_parallel(model, 2)
        batch = mask_sample(MaskCase("override", "llama"))
        model(**sp.shard(batch)).loss.backward()
        sp_calls, calls[:] = list(calls), []
        # Packed samples without a cache: HF would give the core a mask keeping them apart, DeepSpeed gives
        # this function none; refused before any attention runs.
        packed = sp.shard(mask_sample(MaskCase("override-packed", "llama", packed=True)))
        refused_packed = raised(lambda: model(**packed, use_cache=False))
        calls[:] = []
        other(input_ids=batch["input_ids"])
        other_calls = list(calls)
        sp.remove()
        kept = ALL_ATTENTION_FUNCTIONS["sdpa"] is custom
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    ids = {name: {id(m) for m in net.modules()} for name, net in (("sp", model), ("other", other))}
    return {"sp": [(c[0] in ids["sp"], c[1]) for c in sp_calls],
            "other": [(c[0] in ids["other"], c[1]) for c in other_calls],
            "kept_after_remove": kept, "tokens": TOKENS, "packed": refused_packed}
