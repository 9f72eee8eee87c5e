"""DeepSpeed ZeRO (stages 1, 2 and 3). Stages 1 and 2 keep parameters whole and reduce from per-parameter hooks,
which the core's single delivery satisfies.

ZeRO-3 gathers and releases around every submodule's forward and backward: around the tiled call, once, as
wanted; inside it once per shard (and ranks with different shard counts would deadlock). So the children's
parameters become ZeRO-3 external parameters of the MLP, fetched by its own hooks, and ``gathered`` suspends the
descendants' hooks for the shard loop and the recompute. Not ``set_z3_leaf_modules``: it must be set before
``deepspeed.initialize``, and with no input requiring grad it reduces before the tiled backward ran.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, ContextManager, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from . import checked_versions as versions
from .base import (
    SequenceParallelAware,
    Strategy,
    UnsupportedBackendError,
    WaitsForEveryParameter,
    claims_need_process_group,
    process_group_ready,
)
from .deepspeed_sp import ENGINE_CLASS, closure_values, deepspeed_sums_over_sequence_ranks, is_instance_of

_ZERO3_HOOK_OWNER = "DeepSpeedZeRoOffload."  # qualname prefix of the hooks ZeRO-3 puts on every module


def is_zero3_param(param) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def is_zero3_module_hook(hook) -> bool:
    return any(getattr(fn, "__qualname__", "").startswith(_ZERO3_HOOK_OWNER) for fn in _wrapped_functions(hook))


def _wrapped_functions(fn, depth: int = 3):
    # DeepSpeed wraps its hooks in ``torch.compiler.disable`` (``__wrapped__``) and ``instrument_w_nvtx`` (a closure).
    yield fn
    if depth == 0:
        return
    for candidate in (getattr(fn, "__wrapped__", None), *closure_values(fn)):
        if inspect.isfunction(candidate) or inspect.ismethod(candidate):
            yield from _wrapped_functions(candidate, depth - 1)


# Earlier releases gave wrong ZeRO-3 numbers now and then, unexplained (docs/backends.md, "Supported versions and why").
ZERO3_OLDEST = "0.19.8"


@functools.cache
def zero3_version_problem() -> str:
    installed = versions.installed("deepspeed")
    if installed is None or versions.CheckedRange("deepspeed", ZERO3_OLDEST).contains(installed) \
            or versions.unchecked_allowed("deepspeed"):
        return ""
    return (f"deepspeed_zero: ZeRO-3 is checked on DeepSpeed >= {ZERO3_OLDEST} and DeepSpeed {installed} is installed "
            f"(on 0.18.6 and 0.19.0 tiled ZeRO-3 steps were seen to give wrong numbers); pip install "
            f"'deepspeed>={ZERO3_OLDEST}', use ZeRO-1/2, or set TILED_MLP_UNCHECKED_VERSIONS=deepspeed to run it at "
            "your own risk")


class DeepSpeedZeroStrategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):

    name = "deepspeed_zero"
    priority = 200
    claims_from_layout = True
    gathers_params = True

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        # ZeRO-1/2 (and the bf16 optimizer) set ``_hp_mapping`` on every rank, None where the master fragment is elsewhere.
        if any(is_zero3_param(p) or hasattr(p, "_hp_mapping") for p in module.parameters()):
            return True
        return any(is_instance_of(m, ENGINE_CLASS) for m in ancestors)

    def check_supported(self, module: nn.Module) -> None:
        problem = zero3_version_problem()
        if problem and any(is_zero3_param(p) for p in module.parameters()):
            raise UnsupportedBackendError(problem)

    def param_bytes(self, module: nn.Module) -> int:
        # Outside the tiled call ZeRO-3's ``.data`` is empty.
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())

    def allows_untiled_call(self, module: nn.Module) -> bool:
        # Not under ZeRO-3: untiled, each child Linear gathers with its own hooks, so a rank running untiled beside
        # one that tiles would issue other collectives and deadlock. It tiles in one shard instead.
        return not any(is_zero3_param(p) for p in module.parameters())

    def swaps_param_storage(self, module: nn.Module) -> bool:
        return any(is_zero3_param(p) for p in module.parameters())

    def gathered(self, module: nn.Module) -> ContextManager:
        if not any(is_zero3_param(p) for p in module.parameters()):
            return contextlib.nullcontext()  # stages 1 and 2: parameters are whole
        return _zero3_gathered(module)

    def sums_over_sequence_ranks(self, module: nn.Module, group: Any = None) -> bool:
        # Read from the engine wrapping ``module`` (the whole model: a frozen lm_head carries no ZeRO attribute);
        # with a ``group`` the same read checks it.
        return process_group_ready() and deepspeed_sums_over_sequence_ranks(module, group)

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        self.sums_over_sequence_ranks(module, group)

    is_backend_hook = staticmethod(is_zero3_module_hook)


@contextlib.contextmanager
def _zero3_gathered(module: nn.Module) -> Iterator[None]:
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    in_backward = torch._C._current_graph_task_id() != -1
    params: List[Any] = [p for p in module.parameters() if is_zero3_param(p)]  # with DeepSpeed's ds_* attributes
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    running = stack[-1] if stack else None
    if not in_backward and running is not None and running is not module:
        # ZeRO-3's hooks on ``module`` did not run around this call. Where an enclosing module's hooks
        # hold its parameters (a ``set_z3_leaf_modules`` leaf fetches its whole subtree), those hooks
        # release them and gather them again for the backward. Where nobody holds them, nothing would:
        # refused, rather than gathered here and kept by another module for the rest of the step.
        unheld = [p.ds_id for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
        if unheld:
            raise RuntimeError(
                f"TiledMLP: {type(module).__name__}'s tiled call runs inside {type(running).__name__}'s forward, "
                f"not inside its own call, so ZeRO-3's hooks on {type(module).__name__} do not gather its parameters "
                f"{unheld}. Call the module (module(x)), not its forward, and keep it a submodule of the model given "
                "to deepspeed.initialize"
            )
        with _descendant_hooks_suspended(module):
            yield
        return
    if not in_backward:
        _register_descendant_params_as_external(module)
    # Gathering in the backward would release them on exit, before autograd accumulates the recompute's gradients.
    unready = [p.ds_id for p in params if p.ds_status == ZeroParamStatus.INFLIGHT
               or (in_backward and p.ds_status == ZeroParamStatus.NOT_AVAILABLE)]
    if unready:
        raise RuntimeError(f"TiledMLP: ZeRO-3 has not gathered parameters {unready} of {type(module).__name__} when its "
                           "tiled call needs them: its module hooks did not run around the call. Please report the "
                           "model layout.")
    # Still partitioned only at the first call, before the registration above took effect: every rank holds the
    # same statuses at the same point, so this all-gather matches across ranks.
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with GatheredParameters(missing, modifier_rank=None), _descendant_hooks_suspended(module):
        yield


def _register_descendant_params_as_external(module: nn.Module) -> None:
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    own = {id(p) for p in module.parameters(recurse=False)}
    registered = getattr(module, "_external_params", {})
    for p in module.parameters():
        if is_zero3_param(p) and id(p) not in own and id(p) not in registered:
            register_external_parameter(module, p)


@contextlib.contextmanager
def _descendant_hooks_suspended(module: nn.Module) -> Iterator[None]:
    removed: List[Tuple[dict, List[Tuple[int, Any]], Dict[int, Any]]] = []
    try:
        for sub in module.modules():
            if sub is module:
                continue
            for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
                mine = {k: h for k, h in hooks.items() if is_zero3_module_hook(h)}
                if mine:
                    removed.append((hooks, list(hooks.items()), mine))
                    for key in mine:
                        del hooks[key]
        yield
    finally:
        for hooks, original, mine in reversed(removed):
            # Back in their original order; hooks others added or removed meanwhile stay added or removed.
            current = dict(hooks)
            restored = [(k, h) for k, h in original if k in mine or k in current]
            restored += [(k, h) for k, h in current.items() if k not in mine and all(k != ok for ok, _ in original)]
            hooks.clear()
            hooks.update(restored)
