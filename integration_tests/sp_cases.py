"""Ulysses sequence parallelism (``apply_sequence_parallel``) with the tiled MLP and the tiled loss: the
cases, the rank-side runs and the single-process float64 reference.

One case is one training setup: a tiny Hugging Face model (``tiny_models``, float64, 2 query heads and
1 key/value head, 2 layers), an SP group of ``sp`` ranks, ``dp`` such groups, a backend that owns the
weights, a mask pattern and the options on top (``num_items_in_batch``, checkpoint offload, DeepSpeed's
data loader). Every DP group trains on its own full-length samples (``TOKENS``), each SP rank on its
slice of them, for ``STEPS`` SGD steps.

The reference (``reference_run``) is one process: the same model untiled, unoffloaded, without SP, with
sdpa attention, on every DP group's full samples, with Hugging Face's own loss (``ForCausalLMLoss``) in
float64 (its ``logits.float()`` kept float64, as ``tests/loss_reference.py`` does). One reference step
is the step the distributed run takes: the mean over the DP groups of each sample's loss (each rank's
backend averages over its ranks), or, with ``num_items_in_batch`` = the valid labels of all the DP
groups' samples, the sum of each sample's ``sum / N`` (each rank then back-propagates ``dp * loss``, as
the Trainer does for ``average_tokens_across_devices``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F

from tiled_mlp import TiledMLP

from .comparison import ZERO_DTYPE, float_kept_float64
from .loss_cases import tiled_loss_spy
from .training_record import new_record, note_tiled_calls, record_step, sgd_step

TOKENS = 16  # the full length of every sample; each of 2 SP ranks holds 8
STEPS = 2  # SGD steps: the second forward runs on weights the first step moved
LR = 0.5
DTYPE = torch.float64
IGNORE = -100
MLP_SHARDS = (2, 3)  # per SP rank: the ranks tile their slices differently
LOSS_SHARDS = (3, 2)


@dataclass(frozen=True)
class SPCase:
    name: str
    family: str = "llama"
    backend: str = "allreduce"  # "allreduce" (torch all-reduce, averaged), "ddp", "fsdp2", "zero3"
    sp: int = 2
    dp: int = 1
    # "plain": a few labels ignored on both ranks; "uneven": SP rank 0's slice mostly ignored;
    # "empty": one SP rank's slice has no valid label at all (rank d % sp in DP group d).
    masks: str = "plain"
    num_items: bool = False  # num_items_in_batch = the valid labels of every DP group's sample
    offload: bool = False  # HF gradient checkpointing (non-reentrant) + apply_checkpoint_offload
    loader: bool = False  # batches from sp.data_loader(DataLoader) instead of sp.shard()
    # "group": the tiled loss over the SP group (apply_sequence_parallel). "trainer": the HF Trainer's
    # deepspeed_sp_compute_loss over the tiled loss without a group; "trainer-hf": over HF's own loss.
    loss_path: str = "group"

    @property
    def world(self) -> int:
        return self.sp * self.dp

    @property
    def dtype(self) -> torch.dtype:
        """The ranks' model: float64, a DeepSpeed engine's float32 (``comparison.ZERO_DTYPE``)."""
        return ZERO_DTYPE if self.backend.startswith("zero") else DTYPE


# -- the data -----------------------------------------------------------------------------------------
def sp_sample(case: SPCase, step: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, each ``[1, TOKENS]``: DP group ``group``'s full sample at ``step``."""
    from .tiny_models import VOCAB

    g = torch.Generator().manual_seed(1000 * step + 10 * group + 1)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    chunk = TOKENS // case.sp
    # SP rank r's targets are the shifted labels [r * chunk, (r + 1) * chunk): labels[r * chunk + 1 : (r + 1) * chunk + 1].
    if case.masks == "plain":
        labels[0, [2, 5, 11]] = IGNORE
    elif case.masks == "uneven":
        labels[0, 1:chunk] = IGNORE  # SP rank 0 keeps 1 valid target of 8, rank 1 keeps 6 of 8
        labels[0, chunk + 3] = IGNORE
    elif case.masks == "empty":
        empty = group % case.sp
        labels[0, empty * chunk + 1:(empty + 1) * chunk + 1] = IGNORE
        labels[0, (1 - empty) * chunk + 4] = IGNORE
    else:
        raise ValueError(case.masks)
    return ids, labels


def valid_targets(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != IGNORE).sum())


def num_items(case: SPCase, step: int) -> int:
    return sum(valid_targets(sp_sample(case, step, group)[1]) for group in range(case.dp))


def rank_targets(case: SPCase, step: int, rank: int) -> int:
    """Valid targets in SP rank ``rank``'s slice (its DP group's sample)."""
    labels = sp_sample(case, step, rank // case.sp)[1]
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    chunk = TOKENS // case.sp
    r = rank % case.sp
    return int((shifted[:, r * chunk:(r + 1) * chunk] != IGNORE).sum())


# -- the single-process reference ---------------------------------------------------------------------
def hf_loss64(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Hugging Face's ``ForCausalLMLoss``, float64 logits kept float64 (its ``.float()`` patched away)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    with float_kept_float64():
        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=num_items_in_batch)


def reference_model(family: str) -> torch.nn.Module:
    from .tiny_models import tiny_model

    model = tiny_model(family, seed=0, dtype=DTYPE)  # untiled, no SP
    # sdpa, not eager: eager attention takes its softmax in float32 (``softmax(..., dtype=torch.float32)``),
    # 2e-8 off float64 in these gradients; sdpa stays float64.
    model.set_attn_implementation("sdpa")
    return model


def sp_reference_run(case: SPCase) -> Dict:
    """Per step: each DP group's loss (as its ranks return it), every gradient of the step, and every
    parameter after the step."""
    model = reference_model(case.family)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    record: Dict = {"losses": [], "grads": [], "params": [], "initial": {n: p.detach().clone() for n, p in named}}
    for step in range(STEPS):
        count = torch.tensor(num_items(case, step)) if case.num_items else None
        losses = []
        for group in range(case.dp):
            ids, labels = sp_sample(case, step, group)
            losses.append(hf_loss64(model(input_ids=ids).logits, labels, num_items_in_batch=count))
        total = sum(losses) if case.num_items else sum(losses) / case.dp
        total.backward()
        record_step(record, torch.stack(losses), named, sgd_step(optimizer))
    return record


# -- the ranks ----------------------------------------------------------------------------------------
def sp_model(case: SPCase, rank: int):
    """The model as every rank builds it: sdpa attention, checkpointing and offload if asked, tiled MLP
    and tiled loss (each SP rank its own shard counts), then SP. Returns ``(model, SequenceParallel,
    CheckpointOffload or None)``."""
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.offload import apply_checkpoint_offload
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    model = tiny_model(case.family, seed=0, dtype=case.dtype)
    model.set_attn_implementation("sdpa")  # DeepSpeed's SP refuses eager
    model.train()
    if case.offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sp_rank = rank % case.sp
    if case.loss_path != "trainer-hf":
        report = apply_tiled_mlp(model, num_shards=MLP_SHARDS[sp_rank], loss=True, loss_num_shards=LOSS_SHARDS[sp_rank])
        assert len(report.patched) == 2, report
    offload = apply_checkpoint_offload(model) if case.offload else None
    if case.loss_path == "trainer-hf":
        return model, _deepspeed_sp_only(model, case.sp), offload
    sp = apply_sequence_parallel(model, case.sp)
    if case.loss_path == "trainer":
        # The Trainer's composition: DeepSpeed's SP on the attention (accelerate registers it), the tiled
        # loss as on one rank (no group: a mean over this rank's slice), re-weighted by the Trainer.
        from tiled_mlp.integrations.causal_lm_loss import tiled_loss_forward

        tiled_loss_forward(model).sequence_group = None
    return model, sp, offload


def _deepspeed_sp_only(model, size: int):
    """DeepSpeed's SP registered as accelerate does, on a model with its own loss (apply_sequence_parallel
    refuses one): a ``SequenceParallel`` handle for its ``shard`` and ``remove``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiled_mlp.integrations.ulysses import SequenceParallel, undo_attention

    undo = undo_attention(model, "sdpa", ALL_ATTENTION_FUNCTIONS)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=size, micro_batch_size=1,
                                                          seq_length_is_variable=True)
    return SequenceParallel(model, mpu.get_sequence_parallel_group(), mpu, "sdpa", [undo])


def _trainer_loss(model, batch: Dict, case: SPCase) -> torch.Tensor:
    """transformers' ``deepspeed_sp_compute_loss``, what ``Trainer.compute_loss`` calls under
    ``ParallelismConfig(sp_backend="deepspeed")``: each rank's mean re-weighted by its valid tokens over
    DeepSpeed's SP group. It asks ``is_deepspeed_zero3_enabled()`` (from 5.25: ZeRO-3 before DeepSpeed 0.20.2
    averages the SP ranks' gradients, so each rank's share is scaled by the SP size), which answers from the
    DeepSpeed config the Trainer holds while it trains: held here for the call, as the Trainer holds it."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        deepspeed_sp_compute_loss,
        unset_hf_deepspeed_config,
    )

    held = HfDeepSpeedConfig(zero_config(case)) if case.backend.startswith("zero") else None
    try:
        return deepspeed_sp_compute_loss(None, model, dict(batch), False,
                                         SimpleNamespace(sp_backend="deepspeed", sp_size=case.sp))
    finally:
        if held is not None:
            unset_hf_deepspeed_config()


def zero_config(case: SPCase) -> dict:
    zero = {"stage": int(case.backend[-1])}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _wrap_backend(case: SPCase, model, sp, world: int):
    """``(module to call, optimizer or None, engine or None, full grad, full param, reduce grads)``."""
    import torch.distributed as dist

    named = list(model.named_parameters())
    if case.backend == "allreduce":
        def reduce_grads():
            for _, p in named:
                dist.all_reduce(p.grad)
                p.grad /= world
        return model, torch.optim.SGD(model.parameters(), lr=LR), None, (lambda p: p.grad), (lambda p: p), reduce_grads
    if case.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return (DDP(model), torch.optim.SGD(model.parameters(), lr=LR), None, (lambda p: p.grad), (lambda p: p),
                None)
    if case.backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return (model, torch.optim.SGD(model.parameters(), lr=LR), None, (lambda p: p.grad.full_tensor()),
                (lambda p: p.full_tensor()), None)
    if case.backend.startswith("zero"):
        import deepspeed
        from deepspeed.utils import safe_get_full_grad

        from .zero_training import full_param

        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                          config=zero_config(case), mpu=sp.mpu)
        return engine, None, engine, safe_get_full_grad, full_param, None
    raise ValueError(case.backend)


def _loader(case: SPCase, sp, rank: int) -> Iterator[Dict]:
    """DeepSpeed's adapter over this rank's DataLoader of full samples (``position_ids`` included). The
    adapter hands out every SP rank's sample in turn, each split across the group: SP rank r's loader
    holds the samples of the steps ``s % sp == r``, so the adapter yields the steps in order."""
    from torch.utils.data import DataLoader

    group = rank // case.sp
    items = []
    for step in range(STEPS):
        if step % case.sp == rank % case.sp:
            ids, labels = sp_sample(case, step, group)
            items.append({"input_ids": ids[0], "labels": labels[0], "position_ids": torch.arange(TOKENS)})
    return iter(sp.data_loader(DataLoader(items, batch_size=1)))


def run_sp_case(case: SPCase, rank: int, world: int) -> Dict:
    import torch.distributed as dist

    model, sp, offload = sp_model(case, rank)
    module, optimizer, engine, full_grad, full_param, reduce_grads = _wrap_backend(case, model, sp, world)
    named = list(model.named_parameters())  # after fully_shard: its DTensor parameters, the same names
    loader = _loader(case, sp, rank) if case.loader else None
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record: Dict = {**new_record(), "losses": [], "host_bytes": [], "targets": [], "loader_batches": [], "loss_calls": [],
                    "initial": {n: full_param(p).detach().clone() for n, p in named}}
    optimizer_step = engine.step if engine is not None else sgd_step(optimizer)
    for step in range(STEPS):
        ids, labels = sp_sample(case, step, rank // case.sp)
        batch = sp.shard({"input_ids": ids, "labels": labels})
        if loader is not None:
            from_loader = next(loader)
            record["loader_batches"].append(sorted(from_loader) == sorted(batch) and all(
                torch.equal(from_loader[k], batch[k]) for k in batch))
            batch = from_loader
        record["targets"].append(int((batch["shift_labels"] != IGNORE).sum()))
        if case.num_items:
            batch["num_items_in_batch"] = torch.tensor(num_items(case, step))
        calls: List[Dict] = []
        with tiled_loss_spy(calls):
            loss = module(**batch).loss if case.loss_path == "group" else _trainer_loss(module, batch, case)
        record["loss_calls"].append(calls)
        after_forward = offload.host_bytes.current if offload is not None else None
        # The backends average over every rank; with a global num_items_in_batch each DP group's loss
        # is its share of the step's loss, so dp * loss makes the average the step's gradient. Where
        # DeepSpeed sums over the SP ranks instead, the tiled loss's backward hands each rank 1, not sp.
        scaled = loss * case.dp if case.num_items else loss
        if engine is not None:
            engine.backward(scaled)
        else:
            scaled.backward()
            if reduce_grads is not None:
                reduce_grads()
        note_tiled_calls(record, tiled)
        if offload is not None:
            # After the forward, the most at once, and after the backward (the copies go with the graph).
            record["host_bytes"].append((after_forward, offload.host_bytes.peak, offload.host_bytes.current))
            offload.host_bytes.peak = offload.host_bytes.current
        record_step(record, loss, named, optimizer_step, full_grad, full_param)
    if offload is not None:
        offload.remove()
    if engine is not None:
        engine.destroy()
    sp.remove()
    dist.barrier()
    return record


def reference_step(family: str, ids: torch.Tensor, labels: torch.Tensor) -> Dict:
    """One forward and backward of the reference model on a full sample: the loss and every gradient."""
    model = reference_model(family)
    loss = hf_loss64(model(input_ids=ids).logits, labels)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def raised(fn) -> Tuple[str, str]:
    """``(exception type, message)`` of what ``fn()`` raised, or ``("", "nothing raised")``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
        return type(exc).__name__, str(exc)
    return "", "nothing raised"


def _heads_model(heads: int, kv_heads: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiled_mlp.integrations import apply_tiled_loss

    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(DTYPE)
    apply_tiled_loss(model)
    return model


def error_paths(rank: int, world: int) -> Dict:
    """Every refusal of ``apply_sequence_parallel`` and ``shard``, what a refused call leaves behind, and
    what ``remove()`` puts back (after a forward and backward under SP)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.causal_lm_loss import tiled_loss_forward
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    from .tiny_models import tiny_model

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    overrides = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)

    def state(model) -> Dict:
        return {"sdpa_is_original": ALL_ATTENTION_FUNCTIONS["sdpa"] is original,
                "overrides_as_before": dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == overrides,
                "groups_released": parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None
                and parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP is None,
                "loss_group": tiled_loss_forward(model).sequence_group is not None,
                "kv_groups": [layer.self_attn.num_key_value_groups for layer in model.model.layers]}

    out: Dict = {}
    plain = tiny_model("llama", seed=0, dtype=DTYPE)
    plain.set_attn_implementation("sdpa")
    out["no_tiled_loss"] = raised(lambda: apply_sequence_parallel(plain, 2))
    out["query_heads"] = raised(lambda: apply_sequence_parallel(_heads_model(1, 1, 16), 2))
    out["kv_heads"] = raised(lambda: apply_sequence_parallel(_heads_model(6, 3, 24), 2))
    model = tiny_model("llama", seed=0, dtype=DTYPE)  # eager attention
    apply_tiled_mlp(model, num_shards=2, loss=True, loss_num_shards=3)
    out["size_3"] = raised(lambda: apply_sequence_parallel(model, 3))
    out["size_1"] = raised(lambda: apply_sequence_parallel(model, 1))
    out["eager"] = raised(lambda: apply_sequence_parallel(model, 2))
    out["after_eager"] = state(model)
    model.set_attn_implementation("sdpa")
    moe = tiny_model("mixtral", seed=0, dtype=DTYPE)
    moe.set_attn_implementation("sdpa")
    apply_tiled_mlp(moe, loss=True)
    out["moe"] = raised(lambda: apply_sequence_parallel(moe, 2))
    other = tiny_model("llama", seed=1, dtype=DTYPE)  # another model in the process, not under SP
    other.set_attn_implementation("sdpa")
    ids, labels = sp_sample(SPCase("remove"), 0, 0)
    with torch.no_grad():
        other_before = other(input_ids=ids).logits
    sp = apply_sequence_parallel(model, 2)  # the refused calls left nothing in the way
    with torch.no_grad():
        out["other_model_diff"] = float((other(input_ids=ids).logits - other_before).abs().max())
    out["twice"] = raised(lambda: apply_sequence_parallel(model, 2))
    out["odd_tensor"] = raised(lambda: sp.shard({"input_ids": ids, "labels": labels,
                                                  "attention_mask": torch.ones(1, 1, 16, 16)}))
    out["odd_length"] = raised(lambda: sp.shard({"input_ids": ids[:, :15], "labels": labels[:, :15]}))
    out["no_input_ids"] = raised(lambda: sp.shard({"labels": labels}))
    with torch.no_grad():  # evaluation under SP: the whole sequence's loss on every rank, not a slice's
        out["eval_loss"] = model(**sp.shard({"input_ids": ids, "labels": labels})).loss
    model(**sp.shard({"input_ids": ids, "labels": labels})).loss.backward()
    out["under_sp"] = state(model)
    sp.remove()
    out["after_remove"] = state(model)
    model.zero_grad()
    result = model(input_ids=ids, labels=labels)
    result.loss.backward()
    out["plain_after_remove"] = {"loss": result.loss.detach(), "grads": {n: p.grad.clone() for n, p in
                                                                          model.named_parameters()}}
    again = apply_sequence_parallel(model, 2)  # remove() released DeepSpeed's groups
    again.remove()
    out["after_second_remove"] = state(model)
    return out


def run_sp_cases(rank: int, world: int, cases: List[SPCase]) -> Dict[str, Dict]:
    if any(case.backend.startswith("zero") for case in cases):
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    return {case.name: run_sp_case(case, rank, world) for case in cases}


# -- the cases ----------------------------------------------------------------------------------------
def _offloaded(cases) -> Tuple[SPCase, ...]:
    return tuple(SPCase(**{**vars(c), "name": f"{c.name}-offload", "offload": True}) for c in cases)


_MASKS = (
    SPCase("llama-plain"),
    SPCase("qwen2-plain", family="qwen2"),
    SPCase("llama-uneven", masks="uneven"),
    SPCase("qwen2-uneven", family="qwen2", masks="uneven"),
    SPCase("llama-empty-rank", masks="empty"),
    SPCase("qwen2-empty-rank", family="qwen2", masks="empty"),
    SPCase("llama-uneven-num-items", masks="uneven", num_items=True),
    SPCase("qwen2-empty-rank-num-items", family="qwen2", masks="empty", num_items=True),
)
_DDP = (
    SPCase("ddp-llama-uneven", backend="ddp", masks="uneven"),
    SPCase("ddp-qwen2-empty-rank-num-items", family="qwen2", backend="ddp", masks="empty", num_items=True),
)
_FSDP2 = (
    SPCase("fsdp2-llama-uneven", backend="fsdp2", masks="uneven"),
    SPCase("fsdp2-qwen2-uneven", family="qwen2", backend="fsdp2", masks="uneven"),
    SPCase("fsdp2-llama-empty-rank-num-items", backend="fsdp2", masks="empty", num_items=True),
    SPCase("fsdp2-qwen2-empty-rank", family="qwen2", backend="fsdp2", masks="empty"),
)
_LOADER = tuple(SPCase(f"{base.name}-{how}", family=base.family, masks=base.masks, num_items=base.num_items,
                       loader=how == "loader")
                for base in (SPCase("llama-uneven", masks="uneven"),
                             SPCase("qwen2-empty-rank-num-items", family="qwen2", masks="empty", num_items=True))
                for how in ("loader", "shard"))
# ZeRO-1/2 sum the gradients over the SP ranks: recognised (the loss's backward hands each rank 1, not the
# group size), they must match the reference as they are. ZeRO-3 without reduce-scatter and stage 0 are
# integration_tests/test_sp_backends.py's.
_ZERO_SP_SUM = (
    SPCase("zero1-llama-uneven", backend="zero1", masks="uneven"),
    SPCase("zero2-llama-uneven", backend="zero2", masks="uneven"),
    SPCase("zero2-qwen2-empty-rank-num-items", family="qwen2", backend="zero2", masks="empty", num_items=True),
)

GROUPS: Dict[str, Tuple[SPCase, ...]] = {
    "sp2-allreduce-ddp": _MASKS + _DDP,
    "sp2-offload": _offloaded(_MASKS + _DDP),
    "sp2-fsdp2": _FSDP2 + _offloaded(_FSDP2[:1] + _FSDP2[3:]),
    "sp2-loader": _LOADER + _offloaded(_LOADER[:2]),
    "sp2-zero3": (
        SPCase("zero3-llama-uneven", backend="zero3", masks="uneven"),
        SPCase("zero3-qwen2-empty-rank-num-items-offload", family="qwen2", backend="zero3", masks="empty",
               num_items=True, offload=True),
        SPCase("zero3-llama-uneven-offload", backend="zero3", masks="uneven", offload=True),
    ) + _ZERO_SP_SUM,
    "sp2-trainer": (
        SPCase("trainer-zero3-llama-uneven", backend="zero3", masks="uneven", loss_path="trainer"),
        SPCase("trainer-zero3-qwen2-uneven-offload", family="qwen2", backend="zero3", masks="uneven",
               loss_path="trainer", offload=True),
        SPCase("trainer-hf-loss-zero3-llama-empty-rank", backend="zero3", masks="empty", loss_path="trainer-hf"),
        SPCase("trainer-zero3-llama-empty-rank", backend="zero3", masks="empty", loss_path="trainer"),
    ),
    "sp2xdp2-zero3": (
        SPCase("zero3-dp2-llama-uneven-offload", backend="zero3", dp=2, masks="uneven", offload=True),
        SPCase("zero3-dp2-llama-empty-rank-num-items-offload", backend="zero3", dp=2, masks="empty", num_items=True,
               offload=True),
        SPCase("zero3-dp2-qwen2-empty-rank-num-items", family="qwen2", backend="zero3", dp=2, masks="empty",
               num_items=True),
        SPCase("ddp-dp2-llama-empty-rank-num-items", backend="ddp", dp=2, masks="empty", num_items=True),
    ),
}


def frozen_head_grads(rank: int, world: int, backend: str) -> Dict:
    """One step's full gradients under DeepSpeed ``backend`` ("zero1", "zero2") with a frozen ``lm_head``
    (the usual LoRA setup): how DeepSpeed reduces over the SP ranks must be read from DeepSpeed, not from
    the head, whose frozen parameters carry no ZeRO attribute."""
    case = SPCase("frozen-head", backend=backend, masks="uneven")
    model, sp, _ = sp_model(case, rank)
    model.lm_head.requires_grad_(False)
    module, _optimizer, engine, full_grad, _full_param, _reduce = _wrap_backend(case, model, sp, world)
    ids, labels = sp_sample(case, 0, 0)
    loss = module(**sp.shard({"input_ids": ids, "labels": labels})).loss
    engine.backward(loss)
    grads = {n: full_grad(p).detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine.destroy()
    sp.remove()
    return grads
