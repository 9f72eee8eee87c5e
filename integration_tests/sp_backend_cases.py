"""Ulysses SP (``apply_sequence_parallel``) where it meets the backend's reduction: the rank-side runs.

Every run is one forward and backward on 2 gloo processes, SP=2, a tiny Llama (2 layers, tiled MLP and tiled
loss) on ``sp_cases.sample``'s uneven masks, compared with ``sp_cases.reference_step`` (one process, the whole
sequence, float64, Hugging Face's loss). DeepSpeed engines train float32 (ZeRO-3 refuses float64), so their
gradients are held to ``FLOAT32_BOUND``; a backend that sums where the loss expected an average (or the
reverse) is off by a factor of 2 (relative error 0.5 or 1).

``backend_runs`` returns, per case, either ``{"grads": {name: full gradient}}`` or ``{"error": (type,
message)}``, so that refusals and exact runs share one spawned pair.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Tuple

import torch

from .sp_cases import SPCase, raised, sp_sample

FLOAT32_BOUND = 5e-6  # float32 forward and backward against float64; measured worst 5.2e-7
CASE = SPCase("backends", masks="uneven")


def sp_ds_config(stage: int, **zero: Any) -> Dict:
    extra = {k: zero.pop(k) for k in list(zero) if k == "gradient_predivide_factor"}
    zero_opt = {"stage": stage, **zero}
    if stage == 3:
        zero_opt["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero_opt,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9,
            "wall_clock_breakdown": False, **extra}


# name -> DeepSpeed config of an engine built with the SP groups (deepspeed.initialize(mpu=sp.mpu))
DEEPSPEED_EXACT = {
    "zero3-no-reduce-scatter": sp_ds_config(3, reduce_scatter=False),
    "zero3-no-reduce-scatter-no-contiguous": sp_ds_config(3, reduce_scatter=False, contiguous_gradients=False),
    "zero3-reduce-scatter": sp_ds_config(3),
    "zero0-float32": sp_ds_config(0),
    "zero1": sp_ds_config(1),
}
# the same, the engine wrapping a module above the LM: read from the ZeRO optimizer the parameters link to
WRAPPED_EXACT = ("zero3-no-reduce-scatter", "zero1")
DEEPSPEED_REFUSED = {
    # the embedding (1024 elements) and MLP weights (640) above the bucket, the norms (16) below it
    "zero3-no-reduce-scatter-mixed-buckets": sp_ds_config(3, reduce_scatter=False, reduce_bucket_size=100),
    "zero1-predivide": sp_ds_config(1, gradient_predivide_factor=2.0),
}


def sp_llama(dtype: torch.dtype, micro_batch_size: int = 1):
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    model = tiny_model("llama", seed=0, dtype=dtype)
    model.set_attn_implementation("sdpa")
    model.train()
    apply_tiled_mlp(model, num_shards=2, loss=True, loss_num_shards=3)
    return model, apply_sequence_parallel(model, 2, micro_batch_size=micro_batch_size)


def _sharded_sample(sp) -> Dict[str, torch.Tensor]:
    ids, labels = sp_sample(CASE, 0, 0)
    return sp.shard({"input_ids": ids, "labels": labels})


def _raised(fn: Callable[[], Any]) -> Dict:
    return {"error": raised(fn)}


class Wrapper(torch.nn.Module):
    """A module above the causal LM, as a PEFT model is: the engine wraps it, the loss knows the LM."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, **batch):
        return self.inner(**batch)


def _deepspeed_run(config: Dict, wrapped: bool = False) -> Dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model, sp = sp_llama(torch.float32)
    trained = Wrapper(model) if wrapped else model
    engine, *_ = deepspeed.initialize(model=trained, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config, mpu=sp.mpu)
    try:
        loss = engine(**_sharded_sample(sp)).loss
        engine.backward(loss)
        return {"grads": {n: safe_get_full_grad(p).detach().double().clone() for n, p in model.named_parameters()}}
    finally:
        engine.destroy()
        sp.remove()


def _plain_engine_after_remove() -> Dict:
    """SP applied, an engine built with its groups and destroyed, SP removed: a plain engine (no SP) then
    builds, and DeepSpeed's groups slot holds what it held before SP."""
    import deepspeed
    from deepspeed.utils import groups

    before = groups.mpu
    model, sp = sp_llama(torch.float32)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=sp_ds_config(1), mpu=sp.mpu)
    engine.destroy()
    sp.remove()
    out: Dict = {"slot_restored": groups.mpu is before}
    plain = torch.nn.Linear(4, 4)
    try:
        engine, *_ = deepspeed.initialize(model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
                                          config=sp_ds_config(1))
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        out["plain_engine"] = f"{type(exc).__name__}: {exc}"
        return out
    out["plain_engine"] = "built"
    out["plain_sp_size"] = engine.sequence_parallel_size
    engine.destroy()
    return out


def _own_rank_groups(rank: int):
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(2)]  # every rank creates every group, in order
    return groups[rank]


def _ddp_off_the_sp_ranks(rank: int) -> Dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, sp = sp_llama(torch.float64)
    ddp = DDP(model, process_group=_own_rank_groups(rank))
    try:
        return _raised(lambda: ddp(**_sharded_sample(sp)).loss.backward())
    finally:
        sp.remove()


def _fsdp2_off_the_sp_ranks() -> Dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, sp = sp_llama(torch.float64)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("sp", "dp"))
    fully_shard(model, mesh=mesh["dp"])  # a one-rank mesh: FSDP2 averages over this rank only
    try:
        return _raised(lambda: model(**_sharded_sample(sp)).loss.backward())
    finally:
        sp.remove()


def _batch_of_two(micro_batch_size: int) -> Tuple[Dict, Any, Any]:
    ids, labels = _two_samples()
    model, sp = sp_llama(torch.float64, micro_batch_size)
    return {"input_ids": ids, "labels": labels}, model, sp


def _batch_size_refusals() -> Dict:
    batch, model, sp = _batch_of_two(1)
    try:
        out = {"shard": _raised(lambda: sp.shard(batch))}
        sliced = sp.shard({"input_ids": batch["input_ids"][:1], "labels": batch["labels"][:1]})
        by_hand = {k: torch.cat([v, v]) for k, v in sliced.items()}  # cut by hand, two samples, past shard()'s check
        out["forward"] = _raised(lambda: model(**by_hand))
        return out
    finally:
        sp.remove()


def _batch_of_two_reference() -> Dict[str, torch.Tensor]:
    """The reference of ``_batch_of_two_grads``: one process, both whole samples, Hugging Face's mean."""
    from .sp_cases import hf_loss64, reference_model

    ids, labels = _two_samples()
    model = reference_model("llama")
    hf_loss64(model(input_ids=ids).logits, labels).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _two_samples() -> Tuple[torch.Tensor, torch.Tensor]:
    other = SPCase("backends", masks="plain")
    return (torch.cat([sp_sample(CASE, 0, 0)[0], sp_sample(other, 1, 0)[0]]),
            torch.cat([sp_sample(CASE, 0, 0)[1], sp_sample(other, 1, 0)[1]]))


def _batch_of_two_grads() -> Dict:
    """micro_batch_size=2: two samples per step, averaged over the SP ranks by hand (all-reduce)."""
    import torch.distributed as dist

    batch, model, sp = _batch_of_two(2)
    try:
        model(**sp.shard(batch)).loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            grads[name] = p.grad / 2
        return {"grads": grads}
    finally:
        sp.remove()


def _whole_sequence_on_every_rank() -> Dict:
    """``shift_labels`` made by hand over the whole sequence, ``shard()`` forgotten: every rank is handed the
    whole sample."""
    import torch.nn.functional as F

    model, sp = sp_llama(torch.float64)
    ids, labels = sp_sample(CASE, 0, 0)
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    try:
        return _raised(lambda: model(input_ids=ids, shift_labels=shift).loss.backward())
    finally:
        sp.remove()


def backend_runs(rank: int, world: int) -> Dict[str, Dict]:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    out: Dict[str, Dict] = {"plain-after-remove": _plain_engine_after_remove()}
    for name, config in DEEPSPEED_EXACT.items():
        out[name] = _deepspeed_run(config)
    for name, config in DEEPSPEED_REFUSED.items():
        out[name] = _raised(lambda config=config: _deepspeed_run(config))
    for name in WRAPPED_EXACT:
        out[f"wrapped-{name}"] = _deepspeed_run(DEEPSPEED_EXACT[name], wrapped=True)
    out["wrapped-zero0-float32"] = _raised(lambda: _deepspeed_run(DEEPSPEED_EXACT["zero0-float32"], wrapped=True))
    out["ddp-own-rank-group"] = _ddp_off_the_sp_ranks(rank)
    out["fsdp2-own-rank-mesh"] = _fsdp2_off_the_sp_ranks()
    out["batch-of-two"] = _batch_size_refusals()
    out["batch-of-two-micro-batch-2"] = _batch_of_two_grads()
    out["whole-sequence-on-every-rank"] = _whole_sequence_on_every_rank()
    return out
