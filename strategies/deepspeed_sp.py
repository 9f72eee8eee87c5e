"""Whether a DeepSpeed engine sums or averages gradients over a sequence-parallel group, read from the engine
itself: per stage and configuration, as docs/long-context-stack.md tabulates for DeepSpeed 0.19.8. The engine is
the closure of the forward pre-hook ``deepspeed.initialize`` puts on the module it wraps; above the model (a PEFT
model), the ZeRO optimizer linked from the parameters, or ZeRO-1/2's master fragments. Private DeepSpeed names
read here: re-check them whenever the pinned DeepSpeed version changes.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional

from torch import nn

from .base import UnsupportedBackendError, check_spans_sequence_group

# DeepSpeed's classes by (module, name): recognised without importing deepspeed.
ENGINE_CLASS = ("deepspeed.runtime.engine", "DeepSpeedEngine")
_STAGE3_CLASS = ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3")

NO_ENGINE_ERROR = (
    "sequence parallelism: DeepSpeed holds sequence-parallel groups (deepspeed.initialize(mpu=...)), but no "
    "DeepSpeed engine wraps {model} or a module inside it, and no ZeRO optimizer is linked to its parameters, so "
    "the tiled loss cannot read whether DeepSpeed sums or averages the gradients over the SP ranks. Build the "
    "engine on this model (deepspeed.initialize(model=model, mpu=sp.mpu, ...)), or use ZeRO (stage 1, 2 or 3)."
)
TWO_BACKENDS_ERROR = (
    "sequence parallelism: a live DeepSpeed engine wraps {model} and {other} trains it too; the tiled loss cannot "
    "tell which one reduces the gradients over the SP ranks. Call engine.destroy() on the DeepSpeed engine (after "
    "its optimizer, ZeRO stage >= 1) before training the model under {other}, or train it with one backend."
)
MIXED_BUCKETS_ERROR = (
    "sequence parallelism: DeepSpeed ZeRO-3 with reduce_scatter: false sums the gradients of parameters of at most "
    "reduce_bucket_size ({size}) elements over the SP ranks but averages those above it ({large}), so no loss "
    "scale makes both right. Set zero_optimization.reduce_scatter: true (averages every gradient), or "
    "reduce_bucket_size >= {largest}."
)
PREDIVIDE_ERROR = (
    "sequence parallelism: DeepSpeed ZeRO-{stage} with gradient_predivide_factor {factor} divides the SP ranks' "
    "gradients differently on different reduction paths; leave gradient_predivide_factor at 1.0 under SP."
)
ENGINE_GROUP_ERROR = (
    "sequence parallelism: the DeepSpeed engine training {model} was built with the SP group of ranks {engine}, "
    "but the loss is split across ranks {loss}. Build the engine with the SP handle's groups: "
    "deepspeed.initialize(..., mpu=sp.mpu)."
)


def is_instance_of(obj: Any, qualified: tuple) -> bool:
    return any((cls.__module__, cls.__name__) == qualified for cls in type(obj).__mro__)


def closure_values(fn: Any) -> List[Any]:
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return values


def optimizer_destroyed(optimizer: Any) -> bool:
    """``destroy()`` removes the per-parameter gradient hooks the ZeRO (or bf16) optimizer reduces through. It
    leaves the engine's pre-hook on the module, and a stage-0 engine keeps nothing that tells: it counts as live."""
    hooks = list(getattr(optimizer, "_grad_acc_hooks", None) or ())
    return bool(hooks) and all(h.hooks_dict_ref() is None or h.id not in h.hooks_dict_ref() for h in hooks)


def engines_of(model: nn.Module) -> List[Any]:
    """The live DeepSpeed engines wrapping ``model`` or a module inside it, newest last."""
    found: List[Any] = []
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            for candidate in closure_values(hook):
                if (is_instance_of(candidate, ENGINE_CLASS) and getattr(candidate, "module", None) is module
                        and not optimizer_destroyed(getattr(candidate, "optimizer", None))):
                    found.append(candidate)
    return found


def deepspeed_holds_sp_groups() -> bool:
    """Has DeepSpeed been handed live SP groups (``groups.mpu``, what ``deepspeed.initialize(mpu=)`` sets)? Asked
    where deepspeed is imported."""
    from deepspeed.utils import groups

    mpu = groups.mpu
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_world_size"):
        return False
    if getattr(mpu, "_SEQUENCE_PARALLEL_GROUP", True) is None:  # DeepSpeed's parallel_state_sp, released
        return False
    return groups._get_sequence_parallel_world_size() > 1


def _ranks(group: Any) -> List[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group))


def engine_sums_over_sequence_ranks(engine: Any, model: nn.Module, group: Optional[Any]) -> bool:
    """Does ``engine`` sum (rather than average) over the SP ranks? Raises where its configuration gives no
    single answer, or where its groups are not the loss's (``group``)."""
    name = type(model).__name__
    sp_size = getattr(engine, "sequence_parallel_size", 1)
    loss_ranks = _ranks(group) if group is not None else None
    if sp_size > 1:
        engine_ranks = _ranks(engine.seq_parallel_group)
        if loss_ranks is not None and engine_ranks != loss_ranks:
            raise UnsupportedBackendError(ENGINE_GROUP_ERROR.format(model=name, engine=engine_ranks, loss=loss_ranks))
    optimizer = engine.optimizer
    sums = _sums(optimizer, model, sp_size, int(engine.zero_optimization_stage()))
    if not sums and group is not None:
        averaged = _ranks(getattr(optimizer, "dp_process_group", None) or engine.seq_data_parallel_group)
        check_spans_sequence_group("the DeepSpeed engine", model, averaged, group,
                                   "Build the engine over every rank (deepspeed.initialize(..., mpu=sp.mpu)).")
    return sums


def _refuse_two_backends(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    from .ddp import wrapping_ddp

    other = ("FSDP2 (fully_shard)" if any(isinstance(m, FSDPModule) for m in model.modules()) else
             "DDP" if wrapping_ddp() is not None else None)
    if other is not None:
        raise UnsupportedBackendError(TWO_BACKENDS_ERROR.format(model=type(model).__name__, other=other))


def _sums(optimizer: Any, model: nn.Module, sp_size: int, stage: Any) -> bool:
    """Stage 0 and ZeRO-1/2 divide by the DP ranks only (they sum over SP); ZeRO-3's reduce-scatter averages over
    every rank, but without it (and with contiguous gradients) a bucket of at most ``reduce_bucket_size`` elements
    sums over SP. ``stage``: "1/2" where only the optimizer is known."""
    stage3 = is_instance_of(optimizer, _STAGE3_CLASS)
    if sp_size <= 1 or (stage3 and (optimizer.reduce_scatter or not optimizer.contiguous_gradients)):
        return False
    if stage == 0 and not stage3:
        return True
    factor = float(getattr(optimizer, "gradient_predivide_factor", 1.0))
    if factor != 1.0:
        raise UnsupportedBackendError(PREDIVIDE_ERROR.format(stage=3 if stage3 else stage, factor=factor))
    if not stage3:
        return True
    size = optimizer.reduce_bucket_size
    numels = {n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    large = sorted(n for n, numel in numels.items() if numel > size)
    if large and len(large) < len(numels):
        shown = ", ".join(large[:3]) + (", ..." if len(large) > 3 else "")
        raise UnsupportedBackendError(MIXED_BUCKETS_ERROR.format(size=size, large=shown, largest=max(numels.values())))
    return not large


def deepspeed_sums_over_sequence_ranks(model: nn.Module, group: Optional[Any]) -> bool:
    """Read from ``model``'s newest engine, else from the ZeRO optimizer its parameters link to; False where
    DeepSpeed trains nothing under SP; refused where DeepSpeed holds SP groups but neither can be found."""
    if "deepspeed" not in sys.modules:
        return False
    engines = engines_of(model)
    if engines:
        _refuse_two_backends(model)
        return engine_sums_over_sequence_ranks(engines[-1], model, group)
    # ZeRO-3 links every parameter it trains; ZeRO-1/2 (with CPU offload) each one whose master fragment this
    # rank holds (every rank holds at least one).
    linked = (getattr(p, "_z3_optimizer", None) or getattr(p, "_zero_optimizer", None) for p in model.parameters())
    optimizer = next((o for o in linked if o is not None and not optimizer_destroyed(o)), None)
    if optimizer is not None:
        return _sums(optimizer, model, getattr(optimizer, "sequence_parallel_size", 1), "1/2")
    if not deepspeed_holds_sp_groups():
        return False
    # destroy() sets every _hp_mapping to None; a live optimizer gives each rank at least one fragment. ZeRO-1/2
    # (or the bf16 optimizer) without CPU offload links no optimizer to the parameters, only master fragments;
    # built while DeepSpeed held the SP groups, it read them, and sums over those ranks.
    if any(getattr(p, "_hp_mapping", None) is not None for p in model.parameters()):
        return True
    raise UnsupportedBackendError(NO_ENGINE_ERROR.format(model=type(model).__name__))
