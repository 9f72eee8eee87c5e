"""DeepSpeed ZeRO (stages 1, 2 and 3).

Stages 1 and 2 keep parameters whole and reduce from per-parameter hooks, which the core's single delivery
satisfies: this strategy only names the backend.

Stage 3 partitions every parameter (``ds_id``/``ds_status``) and puts gather/release hooks around every
submodule's forward and backward. Around the tiled call they are what is wanted, once. Inside it they are not:
the generic kernel calls the MLP's forward per shard, so the child Linears' hooks would all-gather once per
shard and recompute, and ranks with different shard counts would issue different collectives (deadlock, and
ZeRO's trace check fails). So the children's parameters are registered as ZeRO-3 *external parameters* of
the MLP, which its own hooks fetch before its forward and its backward and release after them (after autograd
accumulated their gradients), and ``gathered`` suspends the descendants' ZeRO-3 hooks for the shard loop and
the recompute; at the very first call, before the registration took effect, it gathers with
``GatheredParameters``, one all-gather alike on every rank. Not ``set_z3_leaf_modules``: it must be set before
``deepspeed.initialize``, and its full backward hook fires before the module's backward when no input
requires grad, so gradients would be reduced before the tiled call produced them.

deepspeed is imported lazily, and only once parameters carry ZeRO-3 attributes.
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


def is_zero12_param(param) -> bool:
    # ZeRO-1/2 (and DeepSpeed's bf16 optimizer) link each trained parameter to its fp32 master
    # fragment; the attribute is set on every rank, None where the fragment lives on another rank.
    return hasattr(param, "_hp_mapping")


def is_zero3_module_hook(hook) -> bool:
    """Is ``hook`` one of the gather/release hooks ZeRO-3 registers on every submodule?"""
    return any(getattr(fn, "__qualname__", "").startswith(_ZERO3_HOOK_OWNER) for fn in _wrapped_functions(hook))


def _wrapped_functions(fn, depth: int = 3):
    """``fn`` and the functions its decorators wrap: DeepSpeed decorates these hooks with
    ``torch.compiler.disable`` (which sets ``__wrapped__``) and ``instrument_w_nvtx`` (a closure)."""
    yield fn
    if depth == 0:
        return
    for candidate in (getattr(fn, "__wrapped__", None), *closure_values(fn)):
        if inspect.isfunction(candidate) or inspect.ismethod(candidate):
            yield from _wrapped_functions(candidate, depth - 1)


# ZeRO-3 is checked on DeepSpeed 0.19.8. Before it, tiled ZeRO-3 steps gave wrong numbers now and then, a different
# case each run: on 0.18.6 NaN or 6e-3-off gradients (integration_tests/test_zero.py), on 0.18.6 and 0.19.0 the
# sequence-parallel ZeRO-3 cases' loss 0.4% off at step 0 (2 runs in 3 on 0.19.0, against 3 exact on 0.19.8, the
# rest of the environment unchanged). Unexplained, so refused there rather than left silent;
# TILED_MLP_UNCHECKED_VERSIONS=deepspeed (or all) turns it into the user's risk.
ZERO3_OLDEST = "0.19.8"


@functools.cache
def zero3_version_problem() -> str:
    """Why ZeRO-3 is refused on the installed DeepSpeed ("" where it is checked); read once per process."""
    installed = versions.installed("deepspeed")
    if installed is None or versions.CheckedRange("deepspeed", ZERO3_OLDEST).contains(installed) \
            or versions.unchecked_allowed("deepspeed"):
        return ""
    return (f"deepspeed_zero: ZeRO-3 is checked on DeepSpeed >= {ZERO3_OLDEST} and DeepSpeed {installed} is installed "
            f"(on 0.18.6 and 0.19.0 tiled ZeRO-3 steps were seen to give wrong numbers); pip install "
            f"'deepspeed>={ZERO3_OLDEST}', use ZeRO-1/2, or set TILED_MLP_UNCHECKED_VERSIONS=deepspeed to run it at "
            "your own risk")


class DeepSpeedZeroStrategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):
    """ZeRO reduces in buckets filled by per-parameter hooks on every rank alike: each parameter the
    engine saw as reachable must deliver a gradient, whatever this rank's tokens used."""

    name = "deepspeed_zero"
    priority = 200
    claims_from_layout = True
    gathers_params = True

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        if any(is_zero3_param(p) or is_zero12_param(p) for p in module.parameters()):
            return True
        return any(is_instance_of(m, ENGINE_CLASS) for m in ancestors)

    def check_supported(self, module: nn.Module) -> None:
        """ZeRO-3 on a DeepSpeed release it was not checked on (``zero3_version_problem``): refused before any work.
        On a checked release this is one cached call."""
        problem = zero3_version_problem()
        if problem and any(is_zero3_param(p) for p in module.parameters()):
            raise UnsupportedBackendError(problem)

    def param_bytes(self, module: nn.Module) -> int:
        """Outside the tiled call ZeRO-3 parameters are partitioned (``.data`` is empty): count ``ds_numel``."""
        return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())

    def allows_untiled_call(self, module: nn.Module) -> bool:
        """Not under ZeRO-3: the plain module gathers each child Linear with its own hooks, the tiled
        call gathers them with the MLP's, so a rank running untiled beside one that tiles (fewer tokens
        with num_shards="auto") would issue other collectives and deadlock. It tiles in one shard."""
        return not any(is_zero3_param(p) for p in module.parameters())

    def swaps_param_storage(self, module: nn.Module) -> bool:
        """ZeRO-3 releases each parameter after forward (``.data`` emptied) and re-gathers it before
        backward; stages 1 and 2 keep them as they are."""
        return any(is_zero3_param(p) for p in module.parameters())

    def gathered(self, module: nn.Module) -> ContextManager:
        if not any(is_zero3_param(p) for p in module.parameters()):
            return contextlib.nullcontext()  # stages 1 and 2: parameters are whole
        return _zero3_gathered(module)

    def sums_over_sequence_ranks(self, module: nn.Module, group: Any = None) -> bool:
        """Read from the DeepSpeed engine that wraps ``module`` (the whole model where the caller has it: a
        frozen ``lm_head`` carries no ZeRO attribute), by its stage and configuration: stage 0 and ZeRO-1/2
        given DeepSpeed's SP groups, and ZeRO-3 with ``reduce_scatter: false``, sum over the SP ranks;
        ZeRO-3's reduce-scatter and an engine without SP groups average (``deepspeed_sp.py``). With a
        ``group``, the same read of the engine checks it (``check_sequence_group``): one walk of the model."""
        return process_group_ready() and deepspeed_sums_over_sequence_ranks(module, group)

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        """Refuse an engine whose SP group is not the loss's, one that averages over ranks that leave SP
        ranks out, one whose configuration has no single factor, and an engine that cannot be found while
        DeepSpeed holds SP groups (``deepspeed_sp.py``)."""
        self.sums_over_sequence_ranks(module, group)

    @staticmethod
    def is_backend_hook(hook) -> bool:
        """ZeRO-3's own hooks are replaced by ``gathered`` inside the tiled call, so a child Linear
        that carries only those may be bypassed by the fast kernel."""
        return is_zero3_module_hook(hook)


@contextlib.contextmanager
def _zero3_gathered(module: nn.Module) -> Iterator[None]:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    in_backward = torch._C._current_graph_task_id() != -1
    params: List[Any] = [p for p in module.parameters() if is_zero3_param(p)]  # with DeepSpeed's ds_* attributes
    running = _running_forward_module()
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
    inflight = [p.ds_id for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
    if inflight:
        raise RuntimeError(
            f"TiledMLP: ZeRO-3 parameters {inflight} of {type(module).__name__} are still being fetched by DeepSpeed "
            "when the tiled call needs them. Please report the model layout."
        )
    # What is still partitioned: only at the first call, before the registration above took effect.
    # Every rank holds the same statuses at the same point, so this all-gather matches across ranks.
    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing and in_backward:
        # Gathering here would release the parameters on exit, before autograd accumulates the
        # gradients the recompute returns, into the full-size buffers it needs.
        raise RuntimeError(
            f"TiledMLP: ZeRO-3 did not gather parameters {[p.ds_id for p in missing]} of {type(module).__name__} "
            "before its backward; its module hooks did not run around the tiled call. Please report the model layout."
        )
    with GatheredParameters(missing, modifier_rank=None), _descendant_hooks_suspended(module):
        yield


def _running_forward_module():
    """The module whose forward ZeRO-3 is running now (its own stack of them), or None outside any."""
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    return stack[-1] if stack else None


def _register_descendant_params_as_external(module: nn.Module) -> None:
    """Make ZeRO-3 fetch the children's parameters with the MLP's own hooks (before its forward, again before its
    backward, released after each), each registered once (DeepSpeed keys them by ``id``)."""
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
            # Back in their original order (ZeRO's hooks interleave with others); hooks that others
            # added or removed meanwhile stay added or removed.
            current = dict(hooks)
            restored = [(k, h) for k, h in original if k in mine or k in current]
            restored += [(k, h) for k, h in current.items() if k not in mine and all(k != ok for ok, _ in original)]
            hooks.clear()
            hooks.update(restored)
