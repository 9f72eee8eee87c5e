"""Checkpoint offload under each parameter backend: the cases, the rank-side runs and the single-process
float64 reference (``test_offload_distributed``).

The model is the tiny transformers Llama of ``tiny_models`` with 3 decoder layers (so that two layer
inputs are offloaded at once, not one), in float64, tiled by ``apply_tiled_mlp(model, loss=True)`` (MLP
and loss, 3 shards each), layer checkpointing on (Hugging Face's ``gradient_checkpointing_enable``,
non-reentrant, or torch's ``checkpoint_wrapper`` around each decoder layer), then
``apply_checkpoint_offload(model)``.

Each rank holds its own batch (``SHAPES``: different batch sizes and lengths) with its own ignore mask
(``MASKED``); its loss is ``sum of its valid tokens' cross-entropy / N`` with ``N`` the *global* count of
valid (shifted) labels, all-reduced as the Trainer's ``num_items_in_batch``. DDP, FSDP2 and ZeRO-3 average
gradients over ranks, so each rank back-propagates ``world * loss``: the averaged gradient is the global
loss's. The single-device case takes the two ranks' batches as two micro-batches of one step (gradients
summed, no scaling). ``STEPS`` SGD steps: the first ``OFFLOADED_STEPS`` with the offload, then
``.remove()`` and one more, plain.

The reference: one process, float64, the same initial weights, no tiling, no checkpointing, no offload,
every rank's batch, the loss written out (``loss_cases.case_reference_loss``: Hugging Face's ``ForCausalLMLoss``
without its float32 cast).

Under ZeRO-3 the offload is applied after ``deepspeed.initialize``, or before it
(``OffloadCase.offload_first``): ZeRO-3's forward pre-hook, registered then after the offload's, replaces
each layer's input by an alias (``input.detach()`` through its post-backward function), which is what the
checkpoint saves; the offload must recognise it all the same.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .comparison import ZERO_DTYPE
from .loss_cases import IGNORE, case_reference_loss, valid_count
from .tiny_models import VOCAB
from .training_record import record_step, sgd_step

LAYERS = 3
SHAPES = ((2, 7), (1, 11))  # [batch, sequence] per rank: 14 and 11 tokens
MASKED = (0.25, 0.45)  # fraction of labels set to -100 per rank
STEPS = 3  # SGD steps
OFFLOADED_STEPS = 2  # the first two with the offload; remove() before the third
LR = 0.1
SHARDS = 3  # MLP and loss shards (``"auto"`` would run these tiny sequences untiled)
DTYPE = torch.float64
BACKENDS = ("single", "ddp", "fsdp2", "zero3")
CHECKPOINTING = ("hf", "wrapper")
_WRAPPED = "_checkpoint_wrapped_module."


@dataclass(frozen=True)
class OffloadCase:
    name: str
    backend: str  # one of BACKENDS
    # "hf": gradient_checkpointing_enable(use_reentrant=False); "wrapper": checkpoint_wrapper; "none": the
    # harness's control, the plain model (no tiling, no checkpointing, no offload, the loss written out)
    checkpointing: str
    offload_first: bool = False  # ZeRO-3 only: apply the offload before deepspeed.initialize

    @property
    def plain(self) -> bool:
        return self.checkpointing == "none"


def offload_cases_for(backend: str, checkpointing=CHECKPOINTING) -> Tuple[OffloadCase, ...]:
    cases = tuple(OffloadCase(f"{backend}-{kind}", backend, kind) for kind in checkpointing)
    if backend == "zero3":
        # The control: ZeRO-3's own error against the float64 reference, which the bound is set from.
        cases = (OffloadCase("zero3-plain", backend, "none"), *cases,
                 OffloadCase("zero3-hf-offload-first", backend, "hf", offload_first=True))
    return cases


def tokens(rank: int) -> int:
    batch, length = SHAPES[rank % 2]
    return batch * length


def expected_host_bytes(model: nn.Module, rank: int) -> int:
    """What the offload holds for one forward of ``rank``'s batch: the inputs of all layers but the last,
    ``[tokens, hidden]`` each, in the model's dtype."""
    config = model.config
    itemsize = torch.finfo(model.model.embed_tokens.weight.dtype).bits // 8
    return (config.num_hidden_layers - 1) * tokens(rank) * config.hidden_size * itemsize


# -- the model ----------------------------------------------------------------------------------------
def offload_model(dtype: torch.dtype = DTYPE) -> nn.Module:
    """``tiny_models.tiny_model("llama")`` with 3 layers instead of 2: same config otherwise, same seed,
    float64 (a DeepSpeed rank: ``comparison.ZERO_DTYPE``), eager attention, in training mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .tiny_models import _COMMON

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_hidden_layers": LAYERS})).to(dtype)
    model.set_attn_implementation("eager")
    return model.train()


def checkpointed(model: nn.Module, kind: str) -> nn.Module:
    if kind == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
        assert all(type(layer).__name__ == "CheckpointWrapper" for layer in model.model.layers)
    return model


def unwrapped_name(name: str) -> str:
    """The reference's parameter name (checkpoint_wrapper adds a module level; the rest add none here)."""
    return name.replace(_WRAPPED, "")


# -- the data -----------------------------------------------------------------------------------------
def offload_batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, SHAPES[rank % 2], generator=g)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=g) < MASKED[rank % 2]] = IGNORE
    return ids, labels


def offload_global_count(step: int, world: int) -> int:
    return sum(valid_count(offload_batch(step, rank)[1]) for rank in range(world))


# -- the single-process reference ---------------------------------------------------------------------
def offload_reference_run(world: int) -> Dict:
    """Untiled float64, one process, no checkpointing, every rank's batch: per step the global loss, its
    gradients, and the parameters after the SGD step."""
    model = offload_model()
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    record: Dict = {"losses": [], "grads": [], "params": [], "counts": []}
    for step in range(STEPS):
        count = offload_global_count(step, world)
        loss = sum(case_reference_loss(model(input_ids=ids, use_cache=False).logits, labels, count)
                   for ids, labels in (offload_batch(step, rank) for rank in range(world)))
        loss.backward()
        record["counts"].append(count)
        record_step(record, loss, named, sgd_step(optimizer))
    return record


# -- the ranks ----------------------------------------------------------------------------------------
@dataclass
class Built:
    call: Callable  # the module to call (the model, DDP, DeepSpeed's engine)
    model: nn.Module  # the causal LM itself
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]  # optimizer step and zero_grad
    full_grad: Callable[[torch.Tensor], torch.Tensor]
    full_param: Callable[[torch.Tensor], torch.Tensor]
    destroy: Callable[[], None] = lambda: None


def _build_offload_case(case: OffloadCase, world: int):
    """``(Built, offload handle, tiling report)``."""
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.integrations.offload import apply_checkpoint_offload

    model = offload_model(ZERO_DTYPE if case.backend == "zero3" else DTYPE)
    report = None if case.plain else apply_tiled_mlp(model, num_shards=SHARDS, loss=True, loss_num_shards=SHARDS)
    if not case.plain:
        checkpointed(model, case.checkpointing)

    def offload_of(model):  # the control: nothing offloaded, nothing held
        return _NoOffload() if case.plain else apply_checkpoint_offload(model)

    scale = 1 if case.backend == "single" else world  # the averaging backends: see the module docstring
    if case.backend in ("single", "ddp", "fsdp2"):
        if case.backend == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:  # the CheckpointWrapper itself with "wrapper": hooks outside
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        offload = offload_of(model)
        call = model
        if case.backend == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            call = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        full = (lambda t: t.full_tensor()) if case.backend == "fsdp2" else (lambda t: t)
        built = Built(call, model, lambda loss: (loss * scale).backward(), step, lambda p: full(p.grad), full)
        return built, offload, report
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from .zero_cases import ZeroCase, zero_ds_config
    from .zero_training import full_param

    offload = offload_of(model) if case.offload_first else None
    config = zero_ds_config(ZeroCase(case.name, stage=3, dtype=ZERO_DTYPE))  # stage3_param_persistence_threshold 0
    config["gradient_clipping"] = 0.0  # DeepSpeed clips at 1.0 by default; the reference takes plain SGD steps
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    if offload is None:
        offload = offload_of(model)
    built = Built(engine, model, lambda loss: engine.backward(loss * scale), engine.step, safe_get_full_grad,
                  full_param, engine.destroy)
    return built, offload, report


class _NoOffload:
    def __init__(self):
        from tiled_mlp.core.checkpoint_offload import HostBytes

        self.host_bytes, self.layers = HostBytes(), []

    def remove(self) -> None:
        pass


def _offload_hooks_left(offload, model: nn.Module) -> int:
    """Hooks bound to ``offload`` still on any module of ``model``."""
    return sum(getattr(hook, "__self__", None) is offload
               for module in model.modules()
               for hooks in (module._forward_pre_hooks, module._forward_hooks) for hook in hooks.values())


def run_offload_case(case: OffloadCase, rank: int, world: int) -> Dict:
    built, offload, report = _build_offload_case(case, world)
    named = [(unwrapped_name(n), p) for n, p in built.model.named_parameters()]
    host = offload.host_bytes
    micro_ranks = list(range(world)) if case.backend == "single" else [rank]
    expected = {r: expected_host_bytes(built.model, r) for r in micro_ranks}
    record: Dict = {"losses": [], "grads": [], "params": [], "counts": [], "host": [], "logits": [],
                    "expected_host_bytes": expected, "offloaded_layers": len(offload.layers),
                    "initial": {n: built.full_param(p).detach().clone() for n, p in named}}
    # No cyclic garbage collection during the steps: what the offload holds must be freed by reference
    # counting alone, right after each backward (a reference cycle would keep step after step alive).
    gc.collect()
    gc.disable()
    try:
        for step in range(STEPS):
            if step == OFFLOADED_STEPS:
                offload.remove()
                record["hooks_left_after_remove"] = _offload_hooks_left(offload, built.model)
            losses, step_host = [], []
            for data_rank in micro_ranks:
                ids, labels = offload_batch(step, data_rank)
                items = torch.tensor(valid_count(labels), dtype=torch.int64)
                if case.backend == "single":
                    items = torch.tensor(offload_global_count(step, world), dtype=torch.int64)
                else:
                    dist.all_reduce(items)  # the Trainer's num_items_in_batch across data-parallel ranks
                if case.plain:
                    logits = built.call(input_ids=ids, use_cache=False).logits
                    out = SimpleNamespace(loss=case_reference_loss(logits, labels, items), logits=logits)
                else:
                    out = built.call(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False)
                after_forward = host.current
                built.backward(out.loss)
                step_host.append({"after_forward": after_forward, "after_backward": host.current,
                                  "peak": host.peak})
                losses.append(out.loss.detach().clone())
                record["logits"].append(out.logits is not None)
                record["counts"].append(int(items))
                del out
            record["host"].append(step_host)
            record_step(record, sum(losses), named, built.step, built.full_grad, built.full_param)
    finally:
        gc.enable()
    record["tiled_paths"] = sorted({str(b.tiled.tiling.last_path) for b in report.patched}) if report else []
    built.destroy()
    return record


def run_offload_cases(rank: int, world: int, cases: List[OffloadCase]) -> Dict[str, Dict]:
    if any(case.backend == "zero3" for case in cases):
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    results = {}
    for case in cases:
        results[case.name] = run_offload_case(case, rank, world)
        if dist.is_initialized():
            dist.barrier()
    return results
