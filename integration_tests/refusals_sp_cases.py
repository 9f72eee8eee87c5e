"""What each rank runs for ``test_refusals_sp.py``: Ulysses SP and the tiled loss over a sequence group, refused
where no other test reaches the refusal. Each entry is ``raised``'s ``(exception type, message)``; where the rule
is that a refused call changes nothing, the state it could have changed is returned beside it."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from .sp_cases import DTYPE, SPCase, raised, sp_sample, zero_config

TOKENS = 16  # sp_sample's full length: 8 tokens per rank of 2


def _sdpa_llama_with_tiled_loss() -> nn.Module:
    from tiled_mlp.integrations import apply_tiled_loss

    from .tiny_models import tiny_model

    model = tiny_model("llama", seed=0, dtype=DTYPE)
    model.set_attn_implementation("sdpa")
    apply_tiled_loss(model)
    return model


def _sp_state(model: nn.Module) -> Dict[str, Any]:
    """What apply_sequence_parallel changes, process-wide and on the model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiled_mlp.integrations.causal_lm_loss import tiled_loss_forward
    from tiled_mlp.integrations.seams.deepspeed_internals import sp_groups_exist

    return {"sdpa": ALL_ATTENTION_FUNCTIONS["sdpa"], "overrides": dict(ALL_ATTENTION_FUNCTIONS._local_mapping),
            "groups": sp_groups_exist(), "loss_group": tiled_loss_forward(model).sequence_group,
            "kv_groups": [layer.self_attn.num_key_value_groups for layer in model.model.layers]}


class TransposedRotary(nn.Module):
    """A rotary embedding returning ``[batch, dim, positions]``, not HF's ``[batch, positions, dim]``."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return position_ids[:, None, :].to(x.dtype).expand(-1, 4, -1)


def apply_refusals(rank: int, world: int) -> Dict[str, Any]:
    """Refusals before or while SP is applied: DeepSpeed's SP groups made already (accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")`` makes them), DeepSpeed's own refusal of an attention name nothing
    registered (after it made its groups); and, with no SP applied, a sequence group that is no process group and
    a length-dependent rotary embedding whose output is not laid out as HF's."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from tiled_mlp.core import tiled_cross_entropy
    from tiled_mlp.integrations.seams.deepspeed_internals import init_distributed, release_sp_groups
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel
    from tiled_mlp.integrations.ulysses_rope import whole_sequence_rope

    out: Dict[str, Any] = {}
    model = _sdpa_llama_with_tiled_loss()
    before = _sp_state(model)
    init_distributed(dist.get_backend())
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=world)
    out["groups_exist"] = raised(lambda: apply_sequence_parallel(model, world))
    out["groups_exist_unchanged"] = _sp_state(model) == {**before, "groups": True}
    release_sp_groups()

    model.config._attn_implementation = "no_such_attention"
    out["unregistered"] = raised(lambda: apply_sequence_parallel(model, world))
    out["unregistered_unchanged"] = _sp_state(model) == before

    hidden = torch.randn(1, TOKENS // world, 16, dtype=DTYPE, requires_grad=True)
    labels = torch.zeros(1, TOKENS // world, dtype=torch.long)
    out["not_a_group"] = raised(lambda: tiled_cross_entropy(hidden, model.lm_head, shift_labels=labels,
                                                            sequence_group=list(range(world))))
    out["not_a_group_untouched"] = hidden.grad is None and model.lm_head.weight.grad is None

    rotary = TransposedRotary()
    hooks = whole_sequence_rope([rotary], dist.group.WORLD)
    positions = torch.arange(TOKENS // world)[None] + rank * (TOKENS // world)
    out["rotary_layout"] = raised(lambda: rotary(hidden, position_ids=positions))
    for hook in hooks:
        hook.remove()
    return out


def call_refusals(rank: int, world: int) -> Dict[str, Any]:
    """Refusals of a call under SP: no input_ids nor inputs_embeds, a whole-sequence attention_mask that differs
    between the ranks, and a tiled loss split over ranks the DeepSpeed engine training the model does not hold in
    its SP group."""
    import deepspeed
    import torch.distributed as dist

    from tiled_mlp.core import tiled_cross_entropy
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    out: Dict[str, Any] = {}
    model = _sdpa_llama_with_tiled_loss()
    sp = apply_sequence_parallel(model, world)
    ids, labels = sp_sample(SPCase("refusals"), 0, 0)
    batch = sp.shard({"input_ids": ids, "labels": labels})
    without_ids = {k: v for k, v in batch.items() if k != "input_ids"}
    out["no_ids"] = raised(lambda: model(**without_ids))
    mask = torch.ones(1, TOKENS, dtype=torch.long)
    mask[0, TOKENS - 1 if rank == 0 else 0] = 0  # each rank pads a token of another rank's slice
    out["different_masks"] = raised(lambda: model(**batch, attention_mask=mask))
    out["grads_untouched"] = all(p.grad is None for p in model.parameters())

    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=zero_config(SPCase("refusals", backend="zero1")), mpu=sp.mpu)
    alone = [dist.new_group([r]) for r in range(world)][rank]  # a group of this rank only
    hidden = torch.randn(1, TOKENS // world, 16, dtype=DTYPE, requires_grad=True)
    out["engine_group"] = raised(lambda: tiled_cross_entropy(hidden, model.lm_head, shift_labels=batch["shift_labels"],
                                                             sequence_group=alone, model=model))
    out["engine_group_untouched"] = hidden.grad is None
    engine.destroy()
    sp.remove()
    return out


# Stands for a hub kernel's name (``org/repo``), which DeepSpeed would fetch: no slash, so that nothing is fetched.
LAZY_NAME = "lazily_loaded_attention"


def lazily_registered_attention(rank: int, world: int) -> Tuple[str, str]:
    """A model under SP whose attention name nothing registered before SP: DeepSpeed 0.19.8 loads a hub kernel's
    name (``org/repo``) itself, and transformers registers it then (``load_and_register_attn_kernel``). Loading one
    needs CUDA and the hub, so the registration is made here, where DeepSpeed's lazy import makes it. Another model
    using that name then has no attention to run outside SP: the error of its call."""
    from unittest import mock

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiled_mlp.integrations.seams import deepspeed_internals
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    register = deepspeed_internals.register_ulysses

    def loading_the_kernel_first(model, attention, size, micro_batch_size):
        ALL_ATTENTION_FUNCTIONS.register(attention, sdpa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(attention, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        return register(model, attention, size, micro_batch_size)

    model = _sdpa_llama_with_tiled_loss()
    model.config._attn_implementation = LAZY_NAME
    with mock.patch.object(deepspeed_internals, "register_ulysses", loading_the_kernel_first):
        sp = apply_sequence_parallel(model, world)
    other = tiny_model("llama", seed=1, dtype=DTYPE)
    other.config._attn_implementation = LAZY_NAME
    ids, _ = sp_sample(SPCase("refusals"), 0, 0)
    with torch.no_grad():
        outcome = raised(lambda: other(input_ids=ids))
    sp.remove()
    return outcome
