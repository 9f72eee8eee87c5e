"""FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2's own module hooks, which fire once around the tiled call, unshard the parameters before it and before
its backward, and reduce-scatter the gradients autograd accumulated once into the unsharded parameters: nothing
to gather here, no per-shard collective, so ranks with different shard counts issue the same collectives.

Claimed where the module, a submodule or a recorded ancestor is an ``FSDPModule``, or where an FSDP2 parameter
group manages one of its parameters (``fully_shard(decoder_layer)`` around an MLP tiled first). That reads
FSDP2's private module -> state map: a list of parameter groups from torch 2.12 on (``_fsdp_param_groups``),
one group before (``_fsdp_param_group``); a layout with neither is refused with the torch version named, never
read as "no FSDP2". Refused: Linears inside the MLP that are FSDP2 units of their own (``PER_LINEAR_ERROR``).

``FSDP2Strategy(mesh=...)`` takes the mesh given to ``fully_shard``: the ranks FSDP2 averages over are then
read from it, else from the states managing the module. Under SP a gradient divide factor other than the
number of ranks FSDP2 adds is refused: the tiled loss's factor assumes FSDP2 averages over them.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .base import (
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


def inner_fsdp_units(module: nn.Module) -> List[str]:
    """Names of the submodules (not ``module`` itself) that are FSDP2 units."""
    fsdp_module = _fsdp_module_class()
    return [name for name, m in module.named_modules() if name and isinstance(m, fsdp_module)]


def _unreadable(what: str) -> RuntimeError:
    return RuntimeError(f"tiled-mlp cannot read FSDP2's {what} on torch {torch.__version__}, so it cannot tell which "
                        "FSDP2 unit manages a tiled module (it reads them as torch 2.11 to 2.13 lay them out); "
                        "use one of those torch releases with FSDP2")


def _state_api() -> Optional[Tuple[Any, Any]]:
    """FSDP2's private module -> state map and its state class, where this torch has them."""
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
    """A state's parameter groups: a list from torch 2.12 on, at most one before."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    raise _unreadable("parameter groups (neither _fsdp_param_groups nor _fsdp_param_group)")


def _managing_groups(module: nn.Module) -> Iterator[Any]:
    """The FSDP2 parameter groups that manage a parameter of ``module`` (or of a submodule)."""
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
    """The FSDP2 state whose forward pre- or post-hook ``hook`` is, else None. ``fully_shard`` registers the
    state's own methods (``FSDPState._pre_forward``, ``FSDPState._post_forward``, bound to it) on a unit of one
    module, and on each module of a unit of several (``fully_shard([norm, lm_head])``, as accelerate makes)
    functions wrapping them, whose ``functools.wraps`` leaves the method as ``__wrapped__``: recognised by
    what they are (the bound methods' functions and owner), never by name."""
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
    """The FSDP2 state ``fully_shard`` gave ``module`` (alone or as one module of a unit), else None."""
    api = _state_api()
    ref = api[0].get(module) if api is not None else None
    state = ref() if ref is not None else None
    return state if api is not None and isinstance(state, api[1]) else None


def is_head_unit_hook(head: nn.Module, hook: Any) -> bool:
    """Is ``hook`` FSDP2's forward hook of the unit ``head`` itself belongs to?"""
    state = fsdp2_forward_hook_state(hook)
    return state is not None and state is _state_of(head)


def unit_modules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules of the FSDP2 unit ``module`` belongs to (``fully_shard(module)``: itself alone;
    ``fully_shard([norm, lm_head])``: both), or () outside any."""
    state = _state_of(module)
    if state is None:
        return ()
    modules = getattr(state, "_modules", None)
    if modules is None:
        raise _unreadable("unit's modules (FSDPState._modules)")
    return tuple(modules)


def params_managed_by_fsdp2(module: nn.Module) -> bool:
    """Is a parameter of ``module`` (or of a submodule) sharded by some FSDP2 unit, wherever it is?"""
    return next(_managing_groups(module), None) is not None


def _data_parallel(mesh_info) -> Tuple[List[int], int]:
    """The global ranks FSDP2 averages a gradient over (its data-parallel mesh; where that mesh carries other
    dimensions too, tensor parallelism, its shard and replicate groups), and what it divides their sum by
    without a divide factor (the product of those groups' sizes, ``_get_gradient_divide_factors``)."""
    import torch.distributed as dist

    groups = [g for g in (getattr(mesh_info, n, None) for n in ("shard_process_group", "replicate_process_group"))
              if g is not None]
    divisor = math.prod(g.size() for g in groups)
    if not getattr(mesh_info, "is_spmd_mesh", False):
        return mesh_info.mesh.mesh.flatten().tolist(), divisor
    return [r for g in groups for r in dist.get_process_group_ranks(g)], divisor


@dataclass(frozen=True)
class FSDP2Reduction:
    """How one FSDP2 parameter group reduces its gradients: the global ranks whose gradients it adds, what it
    divides their sum by without a divide factor, and ``set_gradient_divide_factor``'s, which replaces it."""

    ranks: List[int]
    divisor: Optional[int] = None
    divide_factor: Optional[float] = None

    @property
    def averages(self) -> bool:
        """Divided by how many ranks it adds (unknown counts as yes: only FSDP2's own state says otherwise)."""
        return self.divide_factor is None or self.divisor is None or float(self.divide_factor) == self.divisor


def fsdp2_reductions(module: nn.Module) -> List[FSDP2Reduction]:
    """For every FSDP2 parameter group managing a parameter of ``module``: how it reduces."""
    return [FSDP2Reduction(*_data_parallel(group.mesh_info), getattr(group, "gradient_divide_factor", None))
            for group in _managing_groups(module)]


class FSDP2Strategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):
    """FSDP2 reduce-scatters the gradients of a whole group in one collective: every rank must bring
    one for each parameter, whatever its tokens used (hence ``WaitsForEveryParameter``)."""

    name = "fsdp2"
    priority = 100
    claims_from_layout = True

    def __init__(self, mesh: Optional[Any] = None):
        if mesh is not None and mesh.ndim > 2:
            raise ValueError(MESH_ERROR.format(ndim=mesh.ndim))
        #: The ``DeviceMesh`` given to ``fully_shard``; None: read from FSDP2's state where asked.
        self.mesh = mesh

    @classmethod
    @claims_need_process_group
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        fsdp_module = _fsdp_module_class()
        if any(isinstance(m, fsdp_module) for m in (*ancestors, *module.modules())):
            return True
        return params_managed_by_fsdp2(module)

    def swaps_param_storage(self, module: nn.Module) -> bool:
        """FSDP2 frees the unsharded parameters after forward and all-gathers them into new storage
        before backward."""
        return True

    def is_head_call_hook(self, lm_head: nn.Module, hook) -> bool:
        """FSDP2's forward hooks of the unit the head belongs to (its own, or accelerate's ``[norm, lm_head]``)
        surround the loss as they surround ``lm_head(hidden)`` (docs/backends.md, "The head as an FSDP2 unit")."""
        return is_head_unit_hook(lm_head, hook) or self.is_backend_hook(hook)

    def head_call_gathers(self, lm_head: nn.Module) -> bool:
        """The head is a module of an FSDP2 unit whose pre-forward hook it carries: that hook unshards it."""
        hooks = getattr(lm_head, "_forward_pre_hooks", {}).values()
        return any(is_head_unit_hook(lm_head, hook) for hook in hooks)

    def head_call_sees_graph(self, lm_head: nn.Module) -> bool:
        """Not where the head is one module of a unit of several: the model's forward already ran that unit's pass,
        and a second one would put its post-backward between the loss and the norm, reduce-scattering before the
        norm's gradient exists (docs/backends.md, "The head as an FSDP2 unit")."""
        return len(unit_modules(lm_head)) <= 1

    def check_supported(self, module: nn.Module) -> None:
        units = inner_fsdp_units(module)
        if units:
            raise UnsupportedBackendError(PER_LINEAR_ERROR.format(units=", ".join(units)))

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:
        """FSDP2 averages over its mesh: the given mesh, else every mesh managing ``module``'s parameters,
        must hold every SP rank."""
        if not process_group_ready():
            return
        reductions = fsdp2_reductions(module)
        meshes = [self.mesh.mesh.flatten().tolist()] if self.mesh is not None else [r.ranks for r in reductions]
        for ranks in meshes:
            check_spans_sequence_group("FSDP2", module, ranks, group,
                                       "Pass fully_shard a mesh over every rank under SP (init_device_mesh over the "
                                       "world, or a (replicate, shard) mesh that covers it).")
        for reduction in reductions:
            # A divide factor other than the group's size neither averages nor sums over the SP ranks alone
            # in every layout (with SP=2 x DP=2 a factor of 2 could mean either): no loss factor is known right.
            if not reduction.averages:
                raise UnsupportedBackendError(DIVIDE_FACTOR_ERROR.format(
                    model=type(module).__name__, factor=reduction.divide_factor, ranks=reduction.divisor,
                    ranks_list=sorted(set(reduction.ranks)), scale=(reduction.divisor or 1) / float(reduction.divide_factor or 1),
                    count=reduction.divisor))
