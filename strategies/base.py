"""The contract between the backend-neutral tiled core and a parallel backend.

A strategy is an instance: it may carry what its backend needs to know (a process group, a mesh),
given to its constructor, stored with its registration (``register_strategy(cls, **init_kwargs)``)
or read from the runtime by ``configured_for`` when "auto" resolves it. It answers, in the order the
core asks:

1. **Claiming** (abstract: every backend must answer): ``claims(module, ancestors)``, is the tiled
   module run by this backend? The resolver asks the registered classes, highest priority first,
   before any instance exists; the claiming one is then built by ``configured_for``.
2. **Refusing**: ``check_supported(module)`` raises a clear error, before any work, for a
   configuration the backend cannot tile.
3. **Parameters around the tiled call and its recompute**: ``gathered(module)`` makes them whole for
   the shard loop and again for the backward recompute (a no-op where the backend's own module hooks,
   which fire once around the tiled call, already did it); ``is_backend_hook`` names the backend's
   own hooks that ``gathered`` stands in for; ``allows_untiled_call`` says whether a call may run
   the plain module instead (only where that issues the same collectives); ``param_bytes`` sizes the
   whole parameters for the auto shard policy; ``swaps_param_storage`` exempts a backend that
   re-gathers or re-allocates them between forward and backward from the in-place check.
4. **Gradient semantics**:
   - which tensors receive gradients: ``trainable_params(module)``, honoured by both kernels (a
     parameter left out gets no gradient from the tiled call, fast path or generic);
   - what a trainable parameter that no shard used receives: ``unused_grads_as_zeros`` (None, as
     untiled, unless the backend waits for every reachable parameter: ``WaitsForEveryParameter``);
   - how the summed gradients reach the backend: ``deliver_grads(params, grads)``, called once per
     backward of a tiled call, inside ``gathered``, with each parameter's gradient summed over all
     shards. By default they are returned through autograd, which accumulates each into ``.grad``
     **exactly once per parameter per backward**, whatever the shard count. Every backend relies on
     that single delivery: DDP's reducer hooks, FSDP2's post-backward reduce-scatter and ZeRO's
     per-parameter hooks each fire once, as for the untiled module. A backend that reduces gradients
     itself (no wrapper doing it) overrides ``deliver_grads``.

The core asks every strategy all of these (each has a neutral default). Questions only some backends
can answer are mixins a strategy opts into: ``WaitsForEveryParameter`` (zeros for unused parameters)
and ``SequenceParallelAware`` (how its gradient reduction treats a sequence-parallel group; a loss
split across ranks refuses a backend in play that lacks it, ``resolver.sums_over_sequence_ranks``).
"""
from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, List, Optional, Sequence, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import (
    composed_problem,
    is_tensor_parallel_hook,
    local_param_bytes,
    per_shard_problem,
    tensor_parallel_view,
)

_DISTRIBUTED_BUILT = dist.is_available()


def process_group_ready() -> bool:
    """Whether ``torch.distributed`` has an initialised default process group (what every distributed
    backend runs on: ``claims_need_process_group``)."""
    return _DISTRIBUTED_BUILT and dist.is_initialized()


ClaimsFunction = TypeVar("ClaimsFunction", bound=Callable[..., bool])


def claims_need_process_group(claims: ClaimsFunction) -> ClaimsFunction:
    """Decorates a strategy's ``claims`` (under ``@classmethod``) for a backend that runs only on an
    initialised process group (DDP, FSDP1/2, DeepSpeed): without one it answers False, and the resolver,
    which reads the mark this leaves on the function when the class is registered, does not ask it at all
    (it runs at every tiled call). The mark belongs to the function: a subclass that writes its own
    ``claims`` is asked as any other."""
    @functools.wraps(claims)
    def claims_where_a_process_group_is(cls: Any, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return process_group_ready() and claims(cls, module, ancestors)

    claims_where_a_process_group_is.needs_process_group = True  # type: ignore[attr-defined]  # read by the registry
    return cast(ClaimsFunction, claims_where_a_process_group_is)


def claims_only_with_process_group(cls: type[Strategy]) -> bool:
    """Whether ``cls``'s ``claims`` is one ``claims_need_process_group`` made."""
    return getattr(cls.claims, "needs_process_group", False) is True


class UnsupportedBackendError(RuntimeError):
    """The module runs under a backend (or a backend configuration) that TiledMLP cannot tile."""


SEQUENCE_SPAN_ERROR = (
    "sequence parallelism: {backend} averages the gradients of {model} over ranks {backend_ranks}, which do not "
    "include every rank {sp_ranks} of the sequence-parallel group: each SP rank's share of the sequence would never "
    "be added to the others'. {fix}"
)


def check_spans_sequence_group(backend: str, model: nn.Module, backend_ranks, group, fix: str) -> None:
    """Raise ``SEQUENCE_SPAN_ERROR`` unless ``backend_ranks`` (the global ranks a backend averages this rank's
    gradients over) include every rank of ``group``."""
    sp_ranks = sorted(dist.get_process_group_ranks(group))
    if not set(sp_ranks) <= set(backend_ranks):
        raise UnsupportedBackendError(SEQUENCE_SPAN_ERROR.format(
            backend=backend, model=type(model).__name__, backend_ranks=sorted(backend_ranks), sp_ranks=sp_ranks,
            fix=fix))


class Strategy(ABC):
    #: Registry key, also accepted as ``TiledMLP(strategy=name)``. An instance built from a registration
    #: under another name (``register_strategy(cls, name=...)``) carries that name.
    name: str = ""
    #: The resolver asks the highest priority first; the single-device fallback has the lowest.
    priority: ClassVar[int] = 0
    #: A trainable parameter that no shard used gets a zero gradient instead of None. Untiled, autograd
    #: leaves it None; but here it is an input of the tiled Function, reachable from the output, so a
    #: backend that waits for a gradient of every reachable parameter needs one.
    unused_grads_as_zeros: ClassVar[bool] = False
    #: Declared capabilities: the call enters ``gathered`` only where ``gathers_params`` is true, and hands
    #: the summed gradients to ``deliver_grads`` only where ``delivers_grads`` is true.
    gathers_params: ClassVar[bool] = False
    delivers_grads: ClassVar[bool] = False

    # -- 1. claiming ------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """Is ``module`` (the tiled MLP, at a forward) run by this backend? ``ancestors`` are the
        modules above it, outermost first, where known (``apply_tiled_mlp`` records them). Asked at
        every tiled call of an "auto" module; one made with ``claims_need_process_group`` only while a
        process group is initialised."""

    @classmethod
    def configured_for(cls, module: nn.Module, ancestors: Sequence[nn.Module] = (), **init_kwargs: Any) -> Strategy:
        """The instance that runs ``module`` once this class claimed it, built from the registered
        ``init_kwargs``. A backend that can read its configuration from the runtime (the process group
        of the DDP wrapper running the call) fills in what was not given; such an override is asked at
        every tiled call of an "auto" module, and must stay cheap. Where a class keeps this default, the
        instance rests on the registered arguments alone, and the registration builds it once: every call
        "auto" resolves to it shares it, as every call of a module given a fixed instance shares that one.
        An instance holds configuration, never the state of a call."""
        return cls(**init_kwargs)

    # -- 2. refusing ------------------------------------------------------------------------------
    def check_supported(self, module: nn.Module) -> None:  # noqa: B027 - optional: most backends refuse nothing
        """Raise a clear error for a configuration this backend cannot tile; called before any work."""

    def check_composed(self, module: nn.Module) -> None:
        """Raise a clear error, at tiling, for a layout composed beside this backend that the library was not
        checked on. Default: Hugging Face's own tensor parallelism from a transformers version its seam does not
        know (``tensor_parallel.composed_problem``)."""
        problem = composed_problem(module)
        if problem:
            raise UnsupportedBackendError(problem)

    # -- 3. parameters around the tiled call ----------------------------------------------------------
    def gathered(self, module: nn.Module) -> ContextManager:
        """Inside: the module's parameters are whole tensors usable by its forward. The default is a
        no-op: the backend's own module hooks (which fire once around the tiled call) did it."""
        return contextlib.nullcontext()

    def is_backend_hook(self, hook) -> bool:
        """Is this hook on a submodule of the tiled MLP the backend's own parameter handling, which
        ``gathered`` (or the ``local_view``) stands in for inside the tiled call? Then the fast kernel,
        which bypasses the submodules' ``__call__``, loses nothing by skipping it. Default: a
        tensor-parallel hook of ``parallelize_module`` (``tensor_parallel.py``), nothing else."""
        return is_tensor_parallel_hook(hook)

    def is_head_call_hook(self, lm_head: nn.Module, hook) -> bool:
        """Is this hook on the loss's head the backend's own, which may surround the tiled loss? The loss runs
        as the forward of one call of the head (``tiled_core/head_call.py``): such a hook sees the hidden states
        as the head's input and the loss as its output, and must do with them only what it does around
        ``lm_head(hidden)`` for the parameters (gather them, release them, arrange their backward). Default:
        ``is_backend_hook``'s answer (ZeRO-3's gather and release, a tensor-parallel style's hooks)."""
        return self.is_backend_hook(hook)

    def head_call_gathers(self, lm_head: nn.Module) -> bool:
        """Do the backend's own hooks on the head make its sharded parameters whole for the head's call (and
        again for its backward)? Then the loss, run inside that call, may be asked for with the head's
        parameters sharded (DTensors) outside it. Default: no."""
        return False

    def head_call_sees_graph(self, lm_head: nn.Module) -> bool:
        """May the backend's hooks on the head see the hidden states, graph and all, as the input of the head's
        call around the loss? Default: yes (ZeRO-3 learns from it when the hidden states' gradient is out).
        No: the call is given a detached stand-in, and the loss computes with the hidden states themselves
        (``tiled_core/head_call.py``)."""
        return True

    def local_view(self, module: nn.Module, params: Sequence[torch.Tensor]) -> Optional[Any]:
        """How a kernel that computes on local tensors (the gated fast kernel) sees one call of ``module``
        whose parameters are ``params``: None where they are plain tensors; else an object with ``why_not``
        ("" where it applies), ``enter(x) -> x_local``, ``params(tensors) -> local tensors`` and
        ``leave(out_local) -> out`` (``tiled_core/local_view.py``). Default: tensor parallelism composed
        beside this strategy (``tensor_parallel.tensor_parallel_view``)."""
        return tensor_parallel_view(module, params)

    def per_shard_problem(self, module: nn.Module, token_dims: int) -> str:
        """Why running ``module``'s own forward once per token shard (the generic kernel) would not
        compute what one call does under this backend ("" where it would); ``token_dims``: the input's
        dimensions before the hidden one. Default: tensor-parallel layouts composed beside this strategy
        that shard a token dimension (``tensor_parallel.per_shard_problem``)."""
        return per_shard_problem(module, token_dims)

    def allows_untiled_call(self, module: nn.Module) -> bool:
        """May a call run the plain module instead of the tiled loop (no tokens, or too few for tiling
        to pay)? Only when both issue the same collectives. Default: yes (the backend's hooks sit
        around the call, not inside it)."""
        return True

    def swaps_param_storage(self, module: nn.Module) -> bool:
        """Does the backend replace the parameters' storage between the tiled forward and its backward
        (a re-gather, a re-allocation)? Then the core does not compare their version counters, as it
        does everywhere else to refuse a parameter modified in place in between (autograd's check).
        Default: no."""
        return False

    def head_weight_is_whole(self, lm_head: nn.Module) -> bool:
        """Does the loss's head hold its whole vocabulary in its weight (its rows are the logits' columns)? The
        tiled loss then sizes the vocabulary, and checks the labels against it, before any work; else each
        shard's logits show it. Default: yes, unless the head is a DeepSpeed AutoTP layer, which holds this
        rank's rows and gathers the logits (``deepspeed_autotp.gathers_logits``)."""
        from .deepspeed_autotp import gathers_logits  # that file's strategy is built on this base class

        return not gathers_logits(lm_head)

    def param_bytes(self, module: nn.Module) -> int:
        """Bytes of the module's whole (gathered) parameters, for the auto shard policy: under tensor
        parallelism, the largest share of the ranks' local shards (what a rank's memory holds, alike on every
        rank of the group, so that they all choose one shard count)."""
        return local_param_bytes(module)

    # -- 4. gradient semantics ----------------------------------------------------------------------
    def trainable_params(self, module: nn.Module) -> List[torch.Tensor]:
        """The parameters that receive gradients from the tiled call (both kernels honour it)."""
        return [p for p in module.parameters() if p.requires_grad]

    def deliver_grads(self, params: Sequence[torch.Tensor],
                      grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """What autograd accumulates into each of ``params``: by default the summed gradients
        themselves, once per backward (see the module docstring)."""
        return grads

    def __repr__(self) -> str:
        # What the instance was configured with: its public attributes (a process group, a mesh).
        shown = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({shown})"


class SequenceParallelAware:
    """Mixin for a backend that can say how its gradient reduction treats a sequence-parallel group (ranks
    holding slices of one sequence). A loss split across such a group hands each rank the gradient factor
    that the backend's reduction turns into the whole sequence's gradient (``tiled_core/sequence_group.py``):
    the group's size where the backend *averages* over those ranks, 1 where it *sums* over them.

    Under sequence parallelism every registered strategy with this mixin is asked, not only the one that
    claims the model (a frozen ``lm_head`` is claimed by none): each answers from its backend's own state, or
    from what its instance was configured with. A registered strategy without it that claims the model, or
    one passed to the loss, is refused (``resolver.sums_over_sequence_ranks``)."""

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:  # noqa: B027 - optional: most check nothing
        """Raise, before the loss reduces anything, where this backend, as set up for ``module``'s model,
        cannot carry a loss split across ``group``: a reduction whose ranks do not include every rank of
        ``group`` never adds the SP ranks' shares. Default: nothing to check."""

    def sums_over_sequence_ranks(self, module: nn.Module, group: Any = None) -> bool:
        """Does this backend reduce the model's gradients (``module`` is one of its modules) by *summing*
        over the ranks of ``group`` while averaging over the data-parallel ones? With a ``group``, checks it
        first (``check_sequence_group``); a backend that reads both answers from the same objects overrides
        this to read them once. Default: no (it averages over its ranks, or reduces nothing)."""
        if group is not None:
            self.check_sequence_group(module, group)
        return False


class WaitsForEveryParameter:
    """Mixin for a backend whose reducer waits for a gradient of every parameter reachable from the
    output (DDP's reducer, FSDP2's group reduce-scatter, ZeRO's buckets): an unused one gets zeros,
    delivered once like the others, so that every rank brings one."""

    unused_grads_as_zeros: ClassVar[bool] = True


@dataclass(frozen=True)
class VocabSlice:
    """What a strategy that splits a head's vocabulary over ranks hands the tiled loss
    (``tiled_core/kernels/vocab_parallel.py``): this rank's view of the head, as plain local tensors."""

    #: ``[..., tokens, hidden]``, the head's input on this rank; its gradient here is this rank's part
    #: of a sum over ``group``, which autograd reduces once on the way back.
    hidden: torch.Tensor
    #: ``[rows, hidden]``, this rank's rows of the weight, a view whose gradient reaches the parameter.
    weight: torch.Tensor
    #: ``[rows]`` or None, this rank's entries of the bias, likewise.
    bias: Optional[torch.Tensor]
    #: The process group the vocabulary is split over.
    group: Any
    #: The vocabulary id of this rank's first row.
    start: int
    #: The whole vocabulary.
    vocab_size: int
    #: The most rows any rank of ``group`` holds (the same on every rank).
    max_rows: int
