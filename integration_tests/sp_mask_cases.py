"""Ulysses SP with sliding windows and padding masks: the cases, the rank-side run and
the single-process float64 reference.

A case is a tiny float64 model whose attention is not plain causal order over the whole sequence: a
sliding window of ``WINDOW`` tokens on some or all layers (Mistral, Qwen2's ``use_sliding_window``,
Gemma 3's sliding layers, Phi-3), or a left-padded sample with its 2-D ``attention_mask``. Every case runs on 2 SP ranks (sdpa, tiled MLP and tiled
loss, each rank holding 8 of the ``TOKENS``) and in one process without SP or tiling, on the full sample
(``mask_reference``), one forward and backward each.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .comparison import float_kept_float64
from .sp_cases import hf_loss64, raised
from .tiny_models import VOCAB

TOKENS = 16
WINDOW = 4  # shorter than each rank's slice and than the sequence: the window cuts across ranks
DTYPE = torch.float64
IGNORE = -100
PACKED_AT = 5  # the second document starts inside rank 0's slice and runs across rank 1's
COMMON = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)


@dataclass(frozen=True)
class MaskCase:
    name: str
    family: str
    left_padding: int = 0  # padded tokens at the start of the sample (attention_mask 0, labels ignored)
    positions: str = "arange"  # "arange"; "padded" (generate's cumsum of the mask)
    checkpointing: bool = False  # HF's non-reentrant layer checkpointing: the attention runs again in backward
    packed: bool = False  # two documents in one sample (position_ids restart at PACKED_AT), no attention_mask
    use_cache: Optional[bool] = None  # passed to the model where set (checkpointing in training forces it off)


def build_mask_model(family: str) -> torch.nn.Module:
    """The family's tiny causal LM, float64, sdpa; ``WINDOW``-token windows where the family has them."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=WINDOW))
    elif family == "qwen2":  # layer 0 full, layer 1 sliding (layers >= max_window_layers slide)
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1))
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=WINDOW,
                                                         layer_types=["sliding_attention", "full_attention"]))
    elif family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**dict(COMMON, num_key_value_heads=2), sliding_window=WINDOW,
                                                 pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        raise ValueError(family)
    model = model.to(DTYPE)
    model.set_attn_implementation("sdpa")
    return model


@contextlib.contextmanager
def float64_norms(family: str) -> Iterator[None]:
    """Gemma's RMSNorm computes in float32 (``x.float()``, ``1 + weight.float()``): its weight gradients
    are float32 sums over the tokens, summed in another order over two ranks' slices (1e-7 apart, a
    rounding, not a mask). Kept float64 on both sides, as ``hf_loss64`` keeps the loss."""
    if family != "gemma3":
        yield
        return
    with float_kept_float64():
        yield


def mask_sample(case: MaskCase) -> Dict[str, torch.Tensor]:
    """The full batch: ``input_ids``, ``labels``, ``position_ids`` and, with padding, ``attention_mask``
    (and ``use_cache`` where the case sets it)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    labels[0, 6] = IGNORE
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(TOKENS)[None]}
    if case.packed:
        batch["position_ids"] = torch.cat([torch.arange(PACKED_AT), torch.arange(TOKENS - PACKED_AT)])[None]
    if case.left_padding:
        mask = torch.ones(1, TOKENS, dtype=torch.long)
        mask[0, :case.left_padding] = 0
        ids[0, :case.left_padding] = 0
        labels[0, :case.left_padding] = IGNORE
        batch["attention_mask"] = mask
        if case.positions == "padded":
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0)
    if case.use_cache is not None:
        batch["use_cache"] = case.use_cache
    return batch


def mask_reference(case: MaskCase) -> Dict:
    """One process, untiled, no SP: the loss and every gradient on the full batch."""
    model = build_mask_model(case.family)
    model.train()
    if case.checkpointing:  # HF's mask depends on it: checkpointing in training turns the cache off
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = mask_sample(case)
    labels = batch.pop("labels")
    with float64_norms(case.family):
        loss = hf_loss64(model(**batch).logits, labels)
        loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def run_mask_case(case: MaskCase, rank: int, world: int) -> Dict:
    import torch.distributed as dist

    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    model = build_mask_model(case.family)
    model.train()
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_tiled_mlp(model, num_shards=2 + rank, loss=True, loss_num_shards=3 - rank)
    sp = apply_sequence_parallel(model, 2)
    with float64_norms(case.family):
        loss = model(**sp.shard(mask_sample(case))).loss
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad / world
    sp.remove()
    return {"loss": loss.detach(), "grads": grads}


def run_mask_cases(rank: int, world: int, cases: List[MaskCase]) -> Dict[str, Dict]:
    return {case.name: run_mask_case(case, rank, world) for case in cases}


def mask_refusals(rank: int, world: int) -> Dict[str, Tuple[str, str]]:
    """What SP refuses at the call (the mask's form, ranks that disagree, padding under a core that cannot
    take it) and at apply (flex attention with a windowed config), and that it still works after each."""
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel
    from tiled_mlp.integrations.ulysses_masks import capture_padding

    out: Dict[str, Tuple[str, str]] = {}
    flex = build_mask_model("mistral")
    flex.config._attn_implementation = "flex_attention"  # refused from the config alone: never run here
    apply_tiled_mlp(flex, loss=True)
    out["flex_window"] = raised(lambda: apply_sequence_parallel(flex, 2))

    model = build_mask_model("llama")
    apply_tiled_mlp(model, loss=True)
    sp = apply_sequence_parallel(model, 2)
    batch = sp.shard(mask_sample(MaskCase("refusals", "llama", left_padding=3)))
    four_d = dict(batch, attention_mask=torch.ones(1, 1, 8, 8))
    out["four_d_mask"] = raised(lambda: model(**four_d))
    one_rank = dict(batch) if rank == 0 else {k: v for k, v in batch.items() if k != "attention_mask"}
    out["one_rank_mask"] = raised(lambda: model(**one_rank))
    hooks = capture_padding(model.get_decoder(), sp.group, "flash")  # as under a flash-attention core
    out["flash_padding"] = raised(lambda: model(**batch))
    for hook in hooks:
        hook.remove()
    out["after"] = ("", repr(float(model(**batch).loss.detach())))
    sp.remove()
    return out


CASES: Tuple[MaskCase, ...] = (
    MaskCase("mistral-window", "mistral"),
    MaskCase("qwen2-sliding-layers", "qwen2"),
    MaskCase("gemma3-sliding-layers", "gemma3"),
    MaskCase("phi3-window", "phi3"),
    MaskCase("llama-left-padding", "llama", left_padding=5),
    MaskCase("llama-left-padding-padded-positions", "llama", left_padding=5, positions="padded"),
    MaskCase("mistral-window-left-padding-one-rank-all-padding", "mistral", left_padding=10),
    MaskCase("gemma3-left-padding-checkpointing", "gemma3", left_padding=3, checkpointing=True),
)
# Packed samples: HF separates the documents exactly when its decoder holds no cache (checkpointing in
# training, use_cache=False), and not with a cache (use_cache=True).
PACKED_CASES: Tuple[MaskCase, ...] = (
    MaskCase("llama-packed-checkpointing", "llama", packed=True, checkpointing=True),
    MaskCase("llama-packed-use-cache-false", "llama", packed=True, use_cache=False),
    MaskCase("llama-packed-use-cache", "llama", packed=True, use_cache=True),
    MaskCase("mistral-packed-checkpointing", "mistral", packed=True, checkpointing=True),
    MaskCase("mistral-packed-use-cache", "mistral", packed=True, use_cache=True),
)


def case_named(name: str) -> Optional[MaskCase]:
    return next((case for case in CASES + PACKED_CASES if case.name == name), None)
