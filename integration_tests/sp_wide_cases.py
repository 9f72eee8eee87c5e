"""Ulysses SP past 2 ranks and beside other parallelisms: the cases, the rank-side runs (one spawn of 4 gloo
processes for all of them) and the single-process references.

- SP=4 (no DP), torch all-reduce averaged over the 4 ranks: the tiled MLP, the tiled loss and the tiled
  RMSNorms, each rank its own shard counts; a Llama with 4 query and 2 key/value heads (DeepSpeed repeats
  each key/value head across 2 ranks) and a Qwen2 with 4 and 4.
- SP=2 x DP=2 under FSDP2: ``fully_shard`` over a 1-D mesh of the world, and over a 2-D (dp, sp) mesh as
  (replicate, shard), HSDP; both average over every rank. Refused: a mesh of the DP ranks only (the SP ranks'
  shares are never added), and a gradient divide factor that is not the mesh's size.
- SP=2 x DP=2 in bfloat16 (torch all-reduce in bfloat16), against a float32 reference.
- Ulysses SP beside DTensor tensor parallelism on the attention projections: refused, before any layer's
  attention runs, whichever is applied first.

Every run but the refusals trains ``STEPS`` SGD steps; each DP group has its own full-length samples (``TOKENS``),
each SP rank its slice. The reference (``reference_run``) is one process on the full samples, untiled, without
SP, sdpa, Hugging Face's loss (``sp_cases.hf_loss64``): the mean over the DP groups of each sample's loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .loss_cases import tiled_loss_spy
from .sp_cases import hf_loss64, raised
from .training_record import new_record, note_tiled_calls, record_step, sgd_step

TOKENS = 16  # divisible by 4: each of 4 SP ranks holds 4 tokens
STEPS = 2
LR = 0.5
VOCAB = 64
IGNORE = -100
MLP_SHARDS = (2, 3, 1, 4)  # per SP rank (also the norms'): every rank tiles its slice differently
LOSS_SHARDS = (3, 2, 4, 1)


@dataclass(frozen=True)
class WideCase:
    name: str
    family: str = "llama"  # "llama": 4 query heads, 2 key/value heads; "qwen2": 4 and 4
    sp: int = 4
    dp: int = 1
    backend: str = "allreduce"  # "allreduce" (torch all-reduce / world), "fsdp2-world", "fsdp2-hsdp"
    dtype: torch.dtype = torch.float64


SP4_CASES = (WideCase("sp4-llama-4q-2kv"), WideCase("sp4-qwen2-4q-4kv", family="qwen2"))
FSDP2_CASES = (WideCase("fsdp2-world-mesh-sp2xdp2", sp=2, dp=2, backend="fsdp2-world"),
               WideCase("fsdp2-hsdp-mesh-sp2xdp2", family="qwen2", sp=2, dp=2, backend="fsdp2-hsdp"))
BF16_CASE = WideCase("bf16-sp2xdp2", sp=2, dp=2, dtype=torch.bfloat16)
BF16_REFERENCE_DTYPE = torch.float32


# -- the model and the data --------------------------------------------------------------------------
def wide_model(family: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """2 layers, hidden 16, 4 query heads (head size 4): SP=4 gives each rank one query head. Built in
    float32 and cast, so that a bfloat16 model and its float32 reference (``rounded_reference``) start
    from the same values."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=4))
    model = model.to(dtype)
    model.set_attn_implementation("sdpa")  # eager's softmax is float32; Ulysses refuses eager anyway
    return model


def wide_sample(case: WideCase, step: int, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, each ``[1, TOKENS]``: DP group ``group``'s sample at ``step``. One SP rank's
    slice has no valid target and another keeps one, which rank changes with the step and the group."""
    g = torch.Generator().manual_seed(1000 * step + 10 * group + 7)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
    labels = ids.clone()
    chunk = TOKENS // case.sp
    # SP rank r's targets are labels[r * chunk + 1 : (r + 1) * chunk + 1] (shifted before the split).
    empty = (step + group + 1) % case.sp
    sparse = (empty + 1) % case.sp
    labels[0, empty * chunk + 1:(empty + 1) * chunk + 1] = IGNORE
    labels[0, sparse * chunk + 2:(sparse + 1) * chunk + 1] = IGNORE
    return ids, labels


# -- the references (the test process) ----------------------------------------------------------------
def sp_wide_reference_run(case: WideCase, dtype: torch.dtype = torch.float64, own_loss: bool = False) -> Dict:
    """One process, the full samples of every DP group, untiled, no SP: per step the DP groups' losses, every
    gradient, every parameter after the step. ``dtype``: the reference's (a bfloat16 case's model rounded to
    bfloat16 first); ``own_loss``: the model's own loss (``labels=``) instead of ``hf_loss64``."""
    model = wide_model(case.family, case.dtype).to(dtype)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    record: Dict = {"losses": [], "grads": [], "params": [], "initial": {n: p.detach().clone() for n, p in named}}
    for step in range(STEPS):
        losses = []
        for group in range(case.dp):
            ids, labels = wide_sample(case, step, group)
            if own_loss:
                losses.append(model(input_ids=ids, labels=labels).loss)
            else:
                losses.append(hf_loss64(model(input_ids=ids).logits, labels))
        (sum(losses) / case.dp).backward()
        record_step(record, torch.stack(losses), named, sgd_step(optimizer))
    return record


# -- the ranks ------------------------------------------------------------------------------------------
def _sp_model(case: WideCase, rank: int):
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    model = wide_model(case.family, case.dtype)
    model.train()
    sp_rank = rank % case.sp
    report = apply_tiled_mlp(model, num_shards=MLP_SHARDS[sp_rank], loss=True, loss_num_shards=LOSS_SHARDS[sp_rank],
                             norms=True)
    return model, apply_sequence_parallel(model, case.sp), len(report.patched)


def _wrap_allreduce(case: WideCase, model, world: int):
    """``(optimizer step, full grad, full param, reduce grads or None)`` for the case's backend."""
    import torch.distributed as dist

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if case.backend == "allreduce":
        def reduce_grads() -> None:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        return sgd_step(optimizer), (lambda p: p.grad), (lambda p: p), reduce_grads
    raise ValueError(case.backend)


def _shard_fsdp2(case: WideCase, model) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if case.backend == "fsdp2-world":
        mesh = init_device_mesh("cpu", (case.sp * case.dp,))
    else:  # DeepSpeed's SP groups are consecutive ranks: the inner mesh dimension
        mesh = init_device_mesh("cpu", (case.dp, case.sp), mesh_dim_names=("dp", "sp"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_sp_wide(case: WideCase, rank: int, world: int) -> Dict:
    """``STEPS`` SGD steps on this rank's slices of its DP group's samples."""
    from tiled_mlp import TiledMLP

    model, sp, patched = _sp_model(case, rank)
    if case.backend.startswith("fsdp2"):
        _shard_fsdp2(case, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        step_fn: Callable[[], None] = sgd_step(optimizer)
        full_grad: Callable = lambda p: p.grad.full_tensor()  # noqa: E731
        full_param: Callable = lambda p: p.full_tensor()  # noqa: E731
        reduce_grads: Optional[Callable[[], None]] = None
    else:
        step_fn, full_grad, full_param, reduce_grads = _wrap_allreduce(case, model, world)
    named = list(model.named_parameters())
    tiled = [m for m in model.modules() if isinstance(m, TiledMLP)]
    record: Dict = {**new_record(), "losses": [], "loss_calls": [], "patched": patched,
                    "initial": {n: full_param(p).detach().clone() for n, p in named}}
    for step in range(STEPS):
        ids, labels = wide_sample(case, step, rank // case.sp)
        calls: List[Dict] = []
        with tiled_loss_spy(calls):
            loss = model(**sp.shard({"input_ids": ids, "labels": labels})).loss
        record["loss_calls"].append(calls)
        loss.backward()
        if reduce_grads is not None:
            reduce_grads()
        note_tiled_calls(record, tiled)
        record_step(record, loss, named, step_fn, full_grad, full_param)
    sp.remove()
    return record


def fsdp2_refusals(rank: int) -> Dict[str, Tuple[str, str]]:
    """SP=2 x DP=2 under FSDP2 setups that cannot give the whole sequence's gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    case = WideCase("refused", sp=2, dp=2)
    ids, labels = wide_sample(case, 0, rank // 2)

    def run(shard: Callable[[torch.nn.Module], None]) -> Tuple[str, str]:
        model, sp, _ = _sp_model(case, rank)
        shard(model)
        try:
            return raised(lambda: model(**sp.shard({"input_ids": ids, "labels": labels})).loss.backward())
        finally:
            sp.remove()

    def dp_ranks_only(model) -> None:  # FSDP2 averages over {0, 2} or {1, 3}: never over an SP pair
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))["dp"])

    def divided_by_dp(model) -> None:  # averaged over the DP ranks, summed over the SP ranks
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
        model.set_gradient_divide_factor(2.0)

    out["dp-ranks-only"] = run(dp_ranks_only)
    out["divide-factor"] = run(divided_by_dp)
    return out


def fsdp2_before_sp(rank: int) -> Dict[str, Any]:
    """``fully_shard`` (world mesh) before ``apply_sequence_parallel``: the sharded parameters are DTensors at
    apply time, which the tensor-parallel refusal must not take for TP. One step's full gradients, or
    ``{"refused": message}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    case = FSDP2_CASES[0]
    model = wide_model(case.family, case.dtype)
    apply_tiled_mlp(model, num_shards=2, loss=True, norms=True)
    mesh = init_device_mesh("cpu", (case.sp * case.dp,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        sp = apply_sequence_parallel(model, case.sp)
    except ValueError as error:  # the test reads it: a refusal here is the failure it looks for
        return {"refused": str(error)}
    ids, labels = wide_sample(case, 0, rank // case.sp)
    model(**sp.shard({"input_ids": ids, "labels": labels})).loss.backward()
    sp.remove()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def tensor_parallel_refusals(rank: int) -> Dict[str, Any]:
    """DTensor TP on the attention projections over a (tp, sp) mesh beside the SP groups: TP applied after
    SP (refused at the first attention call) and before it (refused at apply time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.ulysses import apply_sequence_parallel

    case = WideCase("tp", family="qwen2", sp=2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "sp"))  # SP pairs {0, 1}, {2, 3}

    def tensor_parallel(model) -> None:
        plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer.self_attn, mesh["tp"], plan)

    ids, labels = wide_sample(case, 0, 0)  # every TP rank holds the same tokens
    out: Dict[str, Any] = {}
    model = wide_model(case.family, case.dtype)
    apply_tiled_mlp(model, num_shards=2, loss=True)
    sp = apply_sequence_parallel(model, 2)
    tensor_parallel(model)
    try:
        out["tp-after-sp"] = raised(lambda: model(**sp.shard({"input_ids": ids, "labels": labels})))
    finally:
        sp.remove()
    model = wide_model(case.family, case.dtype)
    apply_tiled_mlp(model, num_shards=2, loss=True)
    tensor_parallel(model)
    out["tp-before-sp"] = raised(lambda: apply_sequence_parallel(model, 2))
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    out["groups-released"] = parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None
    dist.barrier()
    return out


def wide_runs(rank: int, world: int) -> Dict[str, Any]:
    """Every case on 4 processes, in turn (each creates and releases DeepSpeed's SP groups)."""
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    out: Dict[str, Any] = {case.name: train_sp_wide(case, rank, world) for case in SP4_CASES + FSDP2_CASES}
    out[BF16_CASE.name] = train_sp_wide(BF16_CASE, rank, world)
    out["fsdp2-refused"] = fsdp2_refusals(rank)
    out["fsdp2-before-sp"] = fsdp2_before_sp(rank)
    out["tp-refused"] = tensor_parallel_refusals(rank)
    return out


def case_by_name(name: str) -> WideCase:
    return {case.name: case for case in (*SP4_CASES, *FSDP2_CASES, BF16_CASE)}[name]


def wide_errors(ref: Dict, record: Dict, group: int) -> Dict[str, float]:
    """``{what: relative error}`` of one rank's record against the reference (its DP group's losses)."""
    from .comparison import rel_error

    out = {f"initial {n}": rel_error(want, record["initial"][n]) for n, want in ref["initial"].items()}
    for step in range(STEPS):
        out[f"step {step} loss"] = rel_error(ref["losses"][step][group], record["losses"][step])
        for name, want in ref["grads"][step].items():
            out[f"step {step} grad {name}"] = rel_error(want, record["grads"][step][name])
        for name, want in ref["params"][step].items():
            out[f"step {step} param {name}"] = rel_error(want, record["params"][step][name])
    return out


def worst_by_kind(errs: Dict[str, float]) -> Dict[str, float]:
    kinds: Dict[str, List[float]] = {}
    for what, err in errs.items():
        kinds.setdefault(what.split(" ")[2] if what.startswith("step") else "initial", []).append(err)
    return {kind: max(values) for kind, values in kinds.items()}
