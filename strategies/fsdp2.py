"""FSDP2 (``torch.distributed.fsdp.fully_shard``). Its own module hooks, which fire once around the tiled call,
unshard the parameters before it and before its backward, and reduce-scatter the gradients autograd accumulated
once: nothing to gather here, and ranks with different shard counts issue the same collectives.

FSDP2's private module -> state map is read as torch 2.11 to 2.13 lay it out; any other layout is refused naming
torch's version, never read as "no FSDP2"."""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .base import (
    HeadCall,
    SequenceParallelAware,
    Strategy,
    UnsupportedBackendError,
    WaitsForEveryParameter,
    check_spans_sequence_group,
    claims_need_process_group,
    process_group_ready,
)

PER_LINEAR_ERROR = (
    "TiledMLP cannot tile a module whose submodules are FSDP2 units of their own ({units}): each "
    "would all-gather and reshard once per token shard (ranks with different token counts would "
    "deadlock), and bypassing them would leave their gradients unreduced. Apply fully_shard to the "
    "MLP, to the TiledMLP, or to the decoder layer that contains it, not to its Linears."
)
DIVIDE_FACTOR_ERROR = (
    "sequence parallelism: FSDP2 divides the gradients of {model} by {factor} (set_gradient_divide_factor) over the "
    "{ranks} ranks {ranks_list}, not by their number: the tiled loss, split across the sequence-parallel group, hands "
    "each rank the factor that an average over every rank turns into the whole sequence's gradient, so every "
    "gradient would come out {scale:g} times the right one. Leave the gradient divide factor unset under SP (FSDP2 then "
    "averages over its mesh), or set it to {count}."
)
MESH_ERROR = (
    "FSDP2Strategy(mesh=...) takes the mesh given to fully_shard: 1-D (shard) or 2-D (replicate, shard), over "
    "all of whose ranks FSDP2 averages; got a {ndim}-D mesh. Leave mesh=None to read the ranks from FSDP2's state."
)


def _fsdp_module_class():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _unreadable(what: str) -> RuntimeError:
    return RuntimeError(f"tiled-mlp cannot read FSDP2's {what} on torch {torch.__version__}, so it cannot tell which "
                        "FSDP2 unit manages a tiled module (it reads them as torch 2.11 to 2.13 lay them out); "
                        "use one of those torch releases with FSDP2")


def _state_api() -> Optional[Tuple[Any, Any]]:
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return None
    return _module_state_mapping, FSDPState


def _fsdp2_states() -> Iterator[Any]:
    api = _state_api()
    if api is None:
        # ``fully_shard`` gives each unit a class of its own under FSDPModule: with none, no FSDP2 state exists.
        if _fsdp_module_class().__subclasses__():
            raise _unreadable("state map")
        return
    mapping, state_class = api
    seen = set()
    for ref in list(mapping.values()):
        state = ref()
        if isinstance(state, state_class) and id(state) not in seen:
            seen.add(id(state))
            yield state


def _param_groups(state: Any) -> List[Any]:
    # A list from torch 2.12 on, at most one before.
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    raise _unreadable("parameter groups (neither _fsdp_param_groups nor _fsdp_param_group)")


def _managing_groups(module: nn.Module) -> Iterator[Any]:
    owners = {id(m) for m in module.modules() if m._parameters}
    if not owners:
        return
    for state in _fsdp2_states():
        for group in _param_groups(state):
            # A shared parameter (tied embeddings) is recorded on its first owner, with the other owners
            # (lm_head) as ``shared_modules``.
            if any(id(m) in owners for fp in group.fsdp_params
                   for m in (fp._module_info.module, *getattr(fp._module_info, "shared_modules", ()))):
                yield group


def fsdp2_forward_hook_state(hook: Any) -> Optional[Any]:
    """The FSDP2 state whose forward pre- or post-hook ``hook`` is, else None: the state's bound method (a unit of
    one module) or, on each module of a unit of several, a wrapper whose ``__wrapped__`` it is; never by name."""
    api = _state_api()
    if api is None:
        return None
    state_class = api[1]
    own = (state_class._pre_forward, state_class._post_forward)
    for _ in range(4):  # the method under at most the group wrapper and torch.compiler.disable's
        if isinstance(hook, types.MethodType):
            owner = hook.__self__
            return owner if isinstance(owner, state_class) and hook.__func__ in own else None
        hook = vars(hook).get("__wrapped__") if hasattr(hook, "__dict__") else None
        if hook is None:
            return None
    return None


def _state_of(module: nn.Module) -> Optional[Any]:
    api = _state_api()
    ref = api[0].get(module) if api is not None else None
    state = ref() if ref is not None else None
    return state if api is not None and isinstance(state, api[1]) else None


def unit_modules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules of the FSDP2 unit ``module`` belongs to, or () outside any."""
    state = _state_of(module)
    if state is None:
        return ()
    modules = getattr(state, "_modules", None)
    if modules is None:
        raise _unreadable("unit's modules (FSDPState._modules)")
    return tuple(modules)


def params_managed_by_fsdp2(module: nn.Module) -> bool:
    return next(_managing_groups(module), None) is not None


def _data_parallel(mesh_info) -> Tuple[List[int], int]:
    """The global ranks FSDP2 averages a gradient over, and what it divides their sum by without a divide factor
    (the product of its shard and replicate groups' sizes, ``_get_gradient_divide_factors``)."""
    import torch.distributed as dist

    groups = [g for g in (getattr(mesh_info, n, None) for n in ("shard_process_group", "replicate_process_group"))
              if g is not None]
    divisor = math.prod(g.size() for g in groups)
    if not getattr(mesh_info, "is_spmd_mesh", False):
        return mesh_info.mesh.mesh.flatten().tolist(), divisor
    return [r for g in groups for r in dist.get_process_group_ranks(g)], divisor


class FSDP2Strategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):

    name = "fsdp2"
    priority = 100
    claims_from_layout = True

    def __init__(self, mesh: Optional[Any] = None):
        if mesh is not None and mesh.ndim > 2:
            raise ValueError(MESH_ERROR.format(ndim=mesh.ndim))
        #: The ``DeviceMesh`` given to ``fully_shard``; None: read from FSDP2's state.
        self.mesh = mesh

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        fsdp_module = _fsdp_module_class()
        return (any(isinstance(m, fsdp_module) for m in (*ancestors, *module.modules()))
                or params_managed_by_fsdp2(module))

    def swaps_param_storage(self, module: nn.Module) -> bool:
        return True

    def head_call(self, lm_head: nn.Module) -> HeadCall:
        """The forward hooks of the head's own unit surround the loss (docs/backends.md, "The head as an FSDP2
        unit"); a head in a unit of several gets a stand-in: a second pass of the unit would reduce-scatter
        before the norm's gradient exists."""
        own = _state_of(lm_head)
        gathers = own is not None and any(fsdp2_forward_hook_state(hook) is own
                                          for hook in getattr(lm_head, "_forward_pre_hooks", {}).values())
        def owns_hook(hook: Any) -> bool:
            return (own is not None and fsdp2_forward_hook_state(hook) is own) or self.is_backend_hook(hook)

        return dataclasses.replace(super().head_call(lm_head), owns_hook=owns_hook, gathers=gathers,
                                   sees_graph=len(unit_modules(lm_head)) <= 1)

    def check_supported(self, module: nn.Module) -> None:
        units = [name for name, m in module.named_modules() if name and isinstance(m, _fsdp_module_class())]
        if units:
            raise UnsupportedBackendError(PER_LINEAR_ERROR.format(units=", ".join(units)))

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        """The given mesh, else every mesh managing ``module``'s parameters, must hold every SP rank."""
        if not process_group_ready():
            return
        groups = list(_managing_groups(module))
        reductions = [(*_data_parallel(g.mesh_info), getattr(g, "gradient_divide_factor", None)) for g in groups]
        meshes = [self.mesh.mesh.flatten().tolist()] if self.mesh is not None else [r[0] for r in reductions]
        for ranks in meshes:
            check_spans_sequence_group("FSDP2", module, ranks, group,
                                       "Pass fully_shard a mesh over every rank under SP (init_device_mesh over the "
                                       "world, or a (replicate, shard) mesh that covers it).")
        for ranks, divisor, factor in reductions:
            # A divide factor other than the group's size neither averages nor sums over the SP ranks alone
            # in every layout (with SP=2 x DP=2 a factor of 2 could mean either): no loss factor is known right.
            if factor is not None and float(factor) != divisor:
                raise UnsupportedBackendError(DIVIDE_FACTOR_ERROR.format(
                    model=type(module).__name__, factor=factor, ranks=divisor, ranks_list=sorted(set(ranks)),
                    scale=divisor / float(factor), count=divisor))
