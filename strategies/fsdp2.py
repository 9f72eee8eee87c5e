"""FSDP2 (``torch.distributed.fsdp.fully_shard``).

When the tiled module sits inside an FSDP2 unit (decoder layer, root) or is one itself, FSDP2's own
module hooks, which fire once around the tiled call, unshard the parameters before it and again
before its backward, and reduce-scatter the gradients that autograd accumulated into the unsharded
parameters. The tiled core delivers each gradient exactly once, so ``gathered`` has nothing to do
and there is no per-shard collective: ranks with different shard counts issue the same collectives.

Claiming: a module is FSDP2's when it, a submodule, or a recorded ancestor is an ``FSDPModule``, or
when one of its parameters is managed by an FSDP2 parameter group. The last test finds the enclosing
unit with no recorded ancestors (``fully_shard(decoder_layer)`` around an MLP that was tiled first):
FSDP2 keeps a process-wide module -> state map, and each of its parameters knows the module that
owns it. That map is private API: a state holds a list of parameter groups from torch 2.12 on
(``_fsdp_param_groups``) and one group before (``_fsdp_param_group``), both read here; a layout neither
has is refused with the torch version named, never taken for "no FSDP2" (a unit missed that way would
skip the checks FSDP2 needs under sequence parallelism).

Rejected: Linears inside the MLP that are FSDP2 units of their own (per-Linear ``fully_shard``).
Their hooks would all-gather and reshard once per token shard (a shard-count-dependent number of
collectives, so ranks with different token counts deadlock), and skipping those hooks would leave
their gradients unreduced: FSDP2 registers a unit's post-backward reduce-scatter in its own
pre-forward hook.

The instance may carry the mesh given to ``fully_shard`` (``FSDP2Strategy(mesh=mesh)``, or registered
with ``register_strategy(FSDP2Strategy, mesh=mesh, override=True)``): the ranks FSDP2 averages over are
then read from it, as given; without one, from the FSDP2 states managing the module's parameters. Under SP a
gradient divide factor (``set_gradient_divide_factor``) other than the number of ranks FSDP2 adds is refused:
the tiled loss's factor assumes FSDP2 averages over them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

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


def _fsdp2_states() -> Iterator[Any]:
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        # ``fully_shard`` gives each unit a class of its own under FSDPModule: with none, no FSDP2 state exists.
        if _fsdp_module_class().__subclasses__():
            raise _unreadable("state map") from None
        return

    seen = set()
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState) and id(state) not in seen:
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


def params_managed_by_fsdp2(module: nn.Module) -> bool:
    """Is a parameter of ``module`` (or of a submodule) sharded by some FSDP2 unit, wherever it is?"""
    return next(_managing_groups(module), None) is not None


def _averaging_ranks(mesh_info) -> List[int]:
    """The global ranks FSDP2 averages a gradient over: its data-parallel mesh (sharded, or replicated and
    sharded); where that mesh carries other dimensions too (tensor parallelism), its shard and replicate
    groups."""
    import torch.distributed as dist

    if not getattr(mesh_info, "is_spmd_mesh", False):
        return mesh_info.mesh.mesh.flatten().tolist()
    ranks: List[int] = []
    for name in ("shard_process_group", "replicate_process_group"):
        group = getattr(mesh_info, name, None)
        if group is not None:
            ranks += dist.get_process_group_ranks(group)
    return ranks


def _default_divisor(mesh_info) -> int:
    """What FSDP2 divides a gradient's sum by when no divide factor is set: the size of its data-parallel
    groups (``_get_gradient_divide_factors``), the product of the shard and replicate group sizes."""
    size = 1
    for name in ("shard_process_group", "replicate_process_group"):
        group = getattr(mesh_info, name, None)
        if group is not None:
            size *= group.size()
    return size


@dataclass(frozen=True)
class FSDP2Reduction:
    """How one FSDP2 parameter group reduces its gradients."""

    ranks: List[int]  # the global ranks whose gradients it adds
    divisor: Optional[int] = None  # what FSDP2 divides their sum by without a divide factor (None: not read)
    divide_factor: Optional[float] = None  # set_gradient_divide_factor's, where set: replaces the divisor

    @property
    def averages(self) -> bool:
        """Divided by how many ranks it adds (unknown counts as yes: only FSDP2's own state says otherwise)."""
        return self.divide_factor is None or self.divisor is None or float(self.divide_factor) == self.divisor


def fsdp2_reductions(module: nn.Module) -> List[FSDP2Reduction]:
    """For every FSDP2 parameter group managing a parameter of ``module``: the ranks it adds and whether it
    averages over them (a divide factor set, ``set_gradient_divide_factor``, replaces the group's size)."""
    return [FSDP2Reduction(_averaging_ranks(group.mesh_info), _default_divisor(group.mesh_info),
                           getattr(group, "gradient_divide_factor", None)) for group in _managing_groups(module)]


class FSDP2Strategy(WaitsForEveryParameter, SequenceParallelAware, Strategy):
    """FSDP2 reduce-scatters the gradients of a whole group in one collective: every rank must bring
    one for each parameter, whatever its tokens used (hence ``WaitsForEveryParameter``)."""

    name = "fsdp2"
    priority = 100

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
