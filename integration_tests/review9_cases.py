"""Rank bodies for integration_tests/test_review9_findings.py: Ulysses SP (size 2, 2 gloo ranks) with the tiled loss
under label smoothing, packed samples (position_ids restarting) and ``num_items_in_batch``, against the same batch
untiled on one process in float64."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F

from .sp_cases import IGNORE, TOKENS, reference_model

SMOOTHING = 0.1


def sp_sample_batch(packed) -> Dict[str, torch.Tensor]:
    """``[1, TOKENS]`` samples. ``True``/"packed": two samples of 6 and 10 tokens, position_ids restarting at 6;
    "right-pad"/"left-pad": 5 padding tokens (attention_mask 0, labels ignored); "batch2": 2 samples, the second
    left-padded."""
    from .tiny_models import VOCAB

    rows = 2 if packed == "batch2" else 1
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (rows, TOKENS), generator=g)
    labels = ids.clone()
    labels[:, [2, 5, 11]] = IGNORE
    positions = torch.arange(TOKENS)[None].expand(rows, -1)
    out = {}
    if packed is True or packed == "packed":
        positions = torch.cat([torch.arange(6), torch.arange(TOKENS - 6)])[None]
        labels[0, 6] = IGNORE  # the second sample's first token is no target of the first
    elif packed in ("right-pad", "left-pad", "batch2"):
        mask = torch.ones_like(ids)
        pad = slice(TOKENS - 5, TOKENS) if packed == "right-pad" else slice(0, 5)
        mask[-1, pad] = 0
        labels[-1, pad] = IGNORE
        out["attention_mask"] = mask
    return {"input_ids": ids, "labels": labels, "position_ids": positions, **out}


def reference_loss_and_grads(packed, smoothing: float, num_items: Optional[int], family: str = "llama") -> Dict:
    """One process, untiled, no SP, float64: sum of smoothed token losses over ``num_items`` (or the mean)."""
    model = reference_model(family)
    data = sp_sample_batch(packed)
    logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"],
                   attention_mask=data.get("attention_mask")).logits
    targets = F.pad(data["labels"], (0, 1), value=IGNORE)[..., 1:]
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                label_smoothing=smoothing, reduction="none")
    loss = per_token.sum() / num_items if num_items is not None else per_token.sum() / (targets != IGNORE).sum()
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def sp_loss_and_grads(rank: int, world: int, packed, smoothing: float, num_items: Optional[int], family: str = "llama",
                      norms: bool = False, compiled: Optional[dict] = None, count_as_int: bool = False) -> Dict:
    from tiled_mlp.integrations import apply_tiled_mlp, set_tiled_loss_label_smoothing
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    model = tiny_model(family, seed=0, dtype=torch.float64)
    model.set_attn_implementation("sdpa")
    model.train()
    apply_tiled_mlp(model, num_shards=2 + rank, loss=True, loss_num_shards=3 - rank, norms=norms)
    if smoothing:
        set_tiled_loss_label_smoothing(model, smoothing)
    sp = apply_sequence_parallel(model, 2, micro_batch_size=2 if packed == "batch2" else 1)
    try:
        kwargs = {}
        if num_items is not None:  # the Trainer passes a tensor or an int
            kwargs["num_items_in_batch"] = num_items if count_as_int else torch.tensor(num_items)
        run = torch.compile(model, backend="aot_eager", **compiled) if compiled is not None else model
        loss = run(**sp.shard(sp_sample_batch(packed)), **kwargs).loss
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.detach().clone()
            torch.distributed.all_reduce(grad)  # averaged over the ranks, as DDP does (the loss's backward hands
            grads[name] = grad / world          # each SP rank the group's sum, so the average is the gradient)
        model.eval()
        with torch.no_grad():  # evaluation under SP takes the tiled loss too (a rank's logits are a slice)
            evaluated = run(**sp.shard(sp_sample_batch(packed)), **kwargs).loss
        return {"loss": loss.detach(), "grads": grads, "eval": evaluated}
    finally:
        sp.remove()


ACCUMULATED = ("packed", "left-pad")  # the micro batches of one optimizer step


def accumulated_targets() -> int:
    return sum(int((sp_sample_batch(kind)["labels"][..., 1:] != IGNORE).sum()) for kind in ACCUMULATED)


def reference_accumulated() -> Dict:
    """Gradient accumulation on one process: each micro batch's smoothed sum over the step's valid targets."""
    model = reference_model("llama")
    count = accumulated_targets()
    for kind in ACCUMULATED:
        data = sp_sample_batch(kind)
        logits = model(input_ids=data["input_ids"], position_ids=data["position_ids"],
                       attention_mask=data.get("attention_mask")).logits
        targets = F.pad(data["labels"], (0, 1), value=IGNORE)[..., 1:]
        (F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, label_smoothing=SMOOTHING,
                         reduction="sum") / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def sp_accumulated(rank: int, world: int) -> Dict:
    """The same micro batches under SP=2, gradients accumulated, ``num_items_in_batch`` the step's count."""
    from tiled_mlp.integrations import apply_tiled_mlp, set_tiled_loss_label_smoothing
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    model = tiny_model("llama", seed=0, dtype=torch.float64)
    model.set_attn_implementation("sdpa")
    model.train()
    apply_tiled_mlp(model, num_shards=2 + rank, loss=True, loss_num_shards=3 - rank, norms=True)
    set_tiled_loss_label_smoothing(model, SMOOTHING)
    sp = apply_sequence_parallel(model, 2)
    try:
        for kind in ACCUMULATED:
            model(**sp.shard(sp_sample_batch(kind)), num_items_in_batch=torch.tensor(accumulated_targets())).loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.detach().clone()
            torch.distributed.all_reduce(grad)
            grads[name] = grad / world
        return grads
    finally:
        sp.remove()


def tp_smoothing_errors(rank: int, world: int, path: str) -> Dict:
    """transformers' tensor parallelism (``tp_plan="auto"``) with the tiled MLP, norms and loss, label smoothing and
    ``num_items_in_batch``, against the same model loaded whole and untiled on this rank: ``{(smoothing, count):
    (loss error, worst gradient error)}``. Both in float64 with HF's ``.float()`` kept float64."""
    from unittest import mock

    from tiled_mlp.integrations import apply_tiled_mlp, set_tiled_loss_label_smoothing

    from .comparison import rel_error
    from .hf_tp_cases import _load, full_tensor
    from .tiny_models import VOCAB

    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :3] = IGNORE
    labels[1, :5] = IGNORE
    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    out = {}
    for smoothing, count in [(SMOOTHING, None), (0.0, 30), (SMOOTHING, 30)]:
        reference = _load(path, tensor_parallel=False)
        model = _load(path, tensor_parallel=True)
        apply_tiled_mlp(model, loss=True, norms=True, num_shards=2, loss_num_shards=3)
        set_tiled_loss_label_smoothing(model, smoothing)
        extra = {"num_items_in_batch": torch.tensor(count)} if count else {}
        with mock.patch.object(torch.Tensor, "float", lambda self: self):
            logits = reference(input_ids=ids).logits
            got = model(input_ids=ids, labels=labels, **extra).loss
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                                    label_smoothing=smoothing, reduction="none")
        want = per_token.sum() / (count if count else (targets != IGNORE).sum())
        want.backward()
        got.backward()
        grads = {name: full_tensor(p.grad) for name, p in model.named_parameters()}
        worst = max(rel_error(p.grad, grads[name]) for name, p in reference.named_parameters())
        out[(smoothing, count)] = (abs(got.item() - want.item()) / abs(want.item()), worst)
    return out
