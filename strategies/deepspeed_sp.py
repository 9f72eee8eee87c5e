"""How a DeepSpeed engine reduces gradients over a sequence-parallel group, read from the engine itself.

Under Ulysses SP every rank returns the whole sequence's loss; the loss's backward must hand each SP rank
the factor that the engine's gradient reduction turns into the whole sequence's gradient: 1 where the
engine *sums* over the SP ranks, the group's size where it *averages* over them
(``tiled_core/sequence_group.py``). DeepSpeed 0.19.8 decides per code path (read from its source):

- the engine's own all-reduce (stage 0, any precision: ``engine.buffered_allreduce_fallback``) divides by
  ``seq_dp_world / sp``, the DP ranks only: it sums over the SP ranks. ``gradient_predivide_factor``
  cancels out on that path.
- ZeRO-1/2 (``stage_1_and_2.py``: ``average_tensor``, ``gradient_reduction_w_predivide``,
  ``allreduce_bucket``) divide by ``dp_world / sp``: they sum over the SP ranks, except the
  no-reduce-scatter path with a predivide factor equal to the world size, which averages.
- ZeRO-3 (``stage3.py``): its reduce-scatter (``__avg_scatter_grads``, via ``reduce_scatter_coalesced``)
  averages over every rank. With ``reduce_scatter: false`` and ``contiguous_gradients`` a bucket no
  larger than ``reduce_bucket_size`` goes through ``__avg_scatter_contiguous_grads`` instead, which divides
  by ``world / sp`` (sums over SP); a bucket holding one parameter larger than that goes through the
  reduce-scatter (averages). So a model with parameters on both sides of ``reduce_bucket_size`` has no
  single factor.
- An engine built without SP groups (``mpu``) has ``sequence_parallel_size`` 1 and averages over its
  data-parallel group.

The engine is found from the model itself: ``deepspeed.initialize`` registers a forward pre-hook on the
module it wraps, a closure over the engine. Where the engine wraps a module above the model the loss knows
(a PEFT model), the ZeRO optimizer is found from the parameters it links to itself (``_z3_optimizer``,
``_zero_optimizer`` with CPU offload); ZeRO-1/2 without offload links only master fragments
(``_hp_mapping``), and an engine built while DeepSpeed held SP groups sums over them (its predivide factor
cannot be read there). Where neither can be found while DeepSpeed holds SP groups
(``deepspeed.utils.groups.mpu``: a float32 stage 0 under a wrapper), or the configuration has no single
factor, the answer is refused with an error that names the fix.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional

from torch import nn

from .base import UnsupportedBackendError

# DeepSpeed private names read here (groups._get_sequence_parallel_world_size, parallel_state_sp's
# _SEQUENCE_PARALLEL_GROUP, the optimizers' _z3_optimizer / _zero_optimizer / _hp_mapping links): re-check
# them against DeepSpeed's source whenever the pinned DeepSpeed version changes.
# DeepSpeed's classes by (module, name): recognized without importing deepspeed (the DeepSpeed strategy
# decides before it is loaded whether it is in play, and reads ENGINE_CLASS from here).
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
ENGINE_SPAN_ERROR = (
    "sequence parallelism: the DeepSpeed engine training {model} averages its gradients over ranks {engine}, which "
    "do not include every rank {loss} of the sequence-parallel group: the SP ranks' shares would not be summed. "
    "Build the engine over every rank (deepspeed.initialize(..., mpu=sp.mpu))."
)


def is_instance_of(obj: Any, qualified: tuple) -> bool:
    """Is ``obj`` an instance of the class ``qualified`` (module, name) names, or of a subclass of it?"""
    return any((cls.__module__, cls.__name__) == qualified for cls in type(obj).__mro__)


def closure_values(fn: Any) -> List[Any]:
    """What a function's closure cells hold (empty cells left out)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return values


def _removed(handle: Any) -> bool:
    hooks = handle.hooks_dict_ref()
    return hooks is None or handle.id not in hooks


def optimizer_destroyed(optimizer: Any) -> bool:
    """Has ``destroy()`` run on this ZeRO (or bf16) optimizer? It removes the per-parameter gradient hooks
    through which the optimizer reduces (``_grad_acc_hooks``); once all are removed it reduces nothing."""
    hooks = list(getattr(optimizer, "_grad_acc_hooks", None) or ())
    return bool(hooks) and all(_removed(h) for h in hooks)


def engine_destroyed(engine: Any) -> bool:
    """``DeepSpeedEngine.destroy()`` leaves the engine's forward pre-hook on the module; what it changes is
    its ZeRO optimizer (``optimizer_destroyed``). A stage-0 engine keeps nothing that tells: it counts as live."""
    return optimizer_destroyed(getattr(engine, "optimizer", None))


def engines_of(model: nn.Module) -> List[Any]:
    """The live DeepSpeed engines wrapping ``model`` or a module inside it, newest last: each is the closure
    of the forward pre-hook ``deepspeed.initialize`` put on the module it wraps (destroyed ones left out)."""
    found: List[Any] = []
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            for candidate in closure_values(hook):
                if (is_instance_of(candidate, ENGINE_CLASS) and getattr(candidate, "module", None) is module
                        and not engine_destroyed(candidate)):
                    found.append(candidate)
    return found


def deepspeed_holds_sp_groups() -> bool:
    """Has DeepSpeed been handed live SP groups (``groups.mpu``, what ``deepspeed.initialize(mpu=)`` sets)?"""
    if "deepspeed" not in sys.modules:
        return False
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
    """Does ``engine`` sum (rather than average) its gradients over the SP ranks? Raises where its
    configuration gives no single answer, or where its groups are not the loss's (``group``)."""
    name = type(model).__name__
    sp_size = getattr(engine, "sequence_parallel_size", 1)
    loss_ranks = _ranks(group) if group is not None else None
    if sp_size > 1:
        engine_ranks = _ranks(engine.seq_parallel_group)
        if loss_ranks is not None and engine_ranks != loss_ranks:
            raise UnsupportedBackendError(ENGINE_GROUP_ERROR.format(model=name, engine=engine_ranks, loss=loss_ranks))
    optimizer = engine.optimizer
    sums = _sums(optimizer, model, sp_size, int(engine.zero_optimization_stage()))
    if not sums and loss_ranks is not None:
        averaged = _ranks(getattr(optimizer, "dp_process_group", None) or engine.seq_data_parallel_group)
        if not set(loss_ranks) <= set(averaged):
            raise UnsupportedBackendError(ENGINE_SPAN_ERROR.format(model=name, engine=averaged, loss=loss_ranks))
    return sums


def _zero3_sums(optimizer: Any, model: nn.Module) -> bool:
    """ZeRO-3 under SP: which of its two reductions every trained parameter's gradient takes."""
    if optimizer.reduce_scatter or not optimizer.contiguous_gradients:
        return False  # reduce-scatter for every bucket: averaged over every rank
    if float(optimizer.gradient_predivide_factor) != 1.0:
        raise UnsupportedBackendError(PREDIVIDE_ERROR.format(stage=3, factor=optimizer.gradient_predivide_factor))
    size = optimizer.reduce_bucket_size
    numels = {n: getattr(p, "ds_numel", p.numel()) for n, p in model.named_parameters() if p.requires_grad}
    large = sorted(n for n, numel in numels.items() if numel > size)
    if not large:
        return True
    if len(large) == len(numels):
        return False
    shown = ", ".join(large[:3]) + (", ..." if len(large) > 3 else "")
    raise UnsupportedBackendError(MIXED_BUCKETS_ERROR.format(size=size, large=shown, largest=max(numels.values())))


def _refuse_two_backends(model: nn.Module) -> None:
    """A live DeepSpeed engine on ``model`` while FSDP2 shards it or a DDP forward runs it: two backends
    reduce the gradients, and no single factor is right for both."""
    from torch.distributed.fsdp import FSDPModule

    from .ddp import _active_ddp_module

    other = ("FSDP2 (fully_shard)" if any(isinstance(m, FSDPModule) for m in model.modules()) else
             "DDP" if _active_ddp_module() is not None else None)
    if other is not None:
        raise UnsupportedBackendError(TWO_BACKENDS_ERROR.format(model=type(model).__name__, other=other))


def zero_optimizer_of(model: nn.Module) -> Optional[Any]:
    """The ZeRO optimizer linked to ``model``'s parameters: ZeRO-3 links every parameter of the module it
    trains (``_z3_optimizer``), ZeRO-1/2 each trained parameter whose master fragment this rank holds
    (``_zero_optimizer``; every rank holds a slice of the flat buffer, so at least one)."""
    for p in model.parameters():
        optimizer = getattr(p, "_z3_optimizer", None) or getattr(p, "_zero_optimizer", None)
        if optimizer is not None and not optimizer_destroyed(optimizer):
            return optimizer
    return None


def _sums(optimizer: Any, model: nn.Module, sp_size: int, stage: Any) -> bool:
    """Does ``optimizer`` (of ZeRO stage ``stage``, "1/2" where only the optimizer is known) sum over its
    ``sp_size`` SP ranks: ZeRO-3 by its reduction paths, stage 0 and ZeRO-1/2 always (a predivide factor refused)."""
    if is_instance_of(optimizer, _STAGE3_CLASS):
        return sp_size > 1 and _zero3_sums(optimizer, model)
    if sp_size <= 1 or stage == 0:
        return sp_size > 1
    factor = float(getattr(optimizer, "gradient_predivide_factor", 1.0))
    if factor != 1.0:
        raise UnsupportedBackendError(PREDIVIDE_ERROR.format(stage=stage, factor=factor))
    return True


def deepspeed_sums_over_sequence_ranks(model: nn.Module, group: Optional[Any]) -> bool:
    """The answer for ``model`` (the whole model where the caller has it): read from its engine (the newest,
    where several were built on it), else from the ZeRO optimizer its parameters are linked to; False where
    DeepSpeed trains nothing under SP; refused where DeepSpeed holds SP groups but neither can be found."""
    if "deepspeed" not in sys.modules:
        return False
    engines = engines_of(model)
    if engines:
        _refuse_two_backends(model)
        return engine_sums_over_sequence_ranks(engines[-1], model, group)
    optimizer = zero_optimizer_of(model)
    if optimizer is not None:
        return _sums(optimizer, model, getattr(optimizer, "sequence_parallel_size", 1), "1/2")
    holds_sp_groups = deepspeed_holds_sp_groups()
    # destroy() sets every _hp_mapping to None; a live optimizer gives each rank at least one fragment.
    if holds_sp_groups and any(getattr(p, "_hp_mapping", None) is not None for p in model.parameters()):
        # ZeRO-1/2 (or the bf16 optimizer) without CPU offload links no optimizer to the parameters, only
        # master fragments; built while DeepSpeed held the SP groups, it read them, and sums over those ranks.
        return True
    if holds_sp_groups:
        raise UnsupportedBackendError(NO_ENGINE_ERROR.format(model=type(model).__name__))
    return False
