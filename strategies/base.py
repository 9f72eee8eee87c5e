"""The contract between the backend-neutral core and a parallel backend (docs/architecture.md, "Adding a
strategy").

A strategy is an instance holding its backend's configuration. Only ``claims`` is required; every other member
has a neutral default, and what a backend does beyond it is *declared*: a flag with its method
(``gathers_params``/``gathered``, ``delivers_grads``/``deliver_grads``, ``configures_from_runtime``/
``configured_for``), ``claims_from_layout``, or a mixin (``WaitsForEveryParameter``, ``SequenceParallelAware``).
A method without its flag, or a flag without its method, is refused when the class is defined and again when
it is registered.
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
    """Whether ``torch.distributed`` has an initialised default process group."""
    return _DISTRIBUTED_BUILT and dist.is_initialized()


ClaimsFunction = TypeVar("ClaimsFunction", bound=Callable[..., bool])


def claims_need_process_group(claims: ClaimsFunction) -> ClaimsFunction:
    """Decorates a strategy's ``claims`` (under ``@classmethod``) for a backend that runs only on an
    initialised process group: without one it answers False, and the resolver does not ask it at all. The
    mark belongs to the function: a subclass that writes its own ``claims`` is asked as any other."""
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


# Each declared capability: the flag, and the method a class sets it with.
CAPABILITIES = (("gathers_params", "gathered"), ("delivers_grads", "deliver_grads"),
                ("configures_from_runtime", "configured_for"))


def check_declarations(obj: Any) -> None:
    """Refuse a class, or an instance (a method set on it), whose capability flags and methods disagree (see
    the module docstring)."""
    cls = obj if isinstance(obj, type) else type(obj)
    for flag, method in CAPABILITIES:
        own = getattr(obj, method)
        base = getattr(Strategy, method)
        declared, defined = getattr(obj, flag), getattr(own, "__func__", own) is not getattr(base, "__func__", base)
        if defined and not declared:
            raise TypeError(f"{cls.__name__} defines {method} but does not declare {flag} = True: the tiled call "
                            f"uses {method} only where the class declares it. Set {flag} = True on {cls.__name__}")
        if declared and not defined and obj is cls:  # a class's definition (an instance's flag comes from it)
            raise TypeError(f"{cls.__name__} declares {flag} = True but does not define {method}: define "
                            f"{method}, or leave {flag} False")


class Strategy(ABC):
    #: Registry key, also accepted as ``TiledMLP(strategy=name)``; a registration under another name
    #: (``register_strategy(cls, name=...)``) gives its instances that name.
    name: str = ""
    #: The resolver asks the highest priority first; the single-device fallback has the lowest.
    priority: ClassVar[int] = 0
    #: Declared capabilities (module docstring).
    gathers_params: ClassVar[bool] = False
    delivers_grads: ClassVar[bool] = False
    configures_from_runtime: ClassVar[bool] = False
    claims_from_layout: ClassVar[bool] = False
    #: Set by ``WaitsForEveryParameter``: a trainable parameter no shard used gets zeros, not None.
    unused_grads_as_zeros: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declarations(cls)

    @classmethod
    @abstractmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """Is ``module`` (the tiled module, at a call) run by this backend? ``ancestors``: the modules above
        it, outermost first, where recorded. Asked of the class, before any instance exists."""

    @classmethod
    def configured_for(cls, module: nn.Module, ancestors: Sequence[nn.Module] = (), **init_kwargs: Any) -> Strategy:
        """The instance that runs ``module`` once this class claimed it (declared by ``configures_from_runtime``:
        an override is asked at every call, so must stay cheap)."""
        return cls(**init_kwargs)

    def check_supported(self, module: nn.Module) -> None:  # noqa: B027 - optional: most backends refuse nothing
        """Raise a clear error for a configuration this backend cannot tile, before any work."""

    def gathered(self, module: nn.Module) -> ContextManager:
        """Inside: the module's parameters are whole (declared by ``gathers_params``)."""
        return contextlib.nullcontext()

    def deliver_grads(self, params: Sequence[torch.Tensor],
                      grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """What autograd accumulates into each of ``params``, given each one's gradient summed over the
        shards, once per backward (declared by ``delivers_grads``)."""
        return grads

    def trainable_params(self, module: nn.Module) -> List[torch.Tensor]:
        """The parameters that receive gradients from the tiled call (both kernels honour it)."""
        return [p for p in module.parameters() if p.requires_grad]

    def allows_untiled_call(self, module: nn.Module) -> bool:
        """May a call run the plain module instead (too few tokens)? Only where both issue the same collectives."""
        return True

    def swaps_param_storage(self, module: nn.Module) -> bool:
        """Does the backend replace the parameters' storage between forward and backward (a re-gather)? Then
        their version counters are not compared to refuse an in-place change in between."""
        return False

    def param_bytes(self, module: nn.Module) -> int:
        """Bytes of the whole parameters for the auto shard policy: under tensor parallelism the largest share
        of the ranks' local shards, alike on every rank so that they choose one shard count."""
        return local_param_bytes(module)

    def is_backend_hook(self, hook) -> bool:
        """Is this hook on a submodule the backend's own parameter handling, which ``gathered`` (or the local
        view) stands in for inside the call, so that the fast kernel may skip it? Default: tensor parallelism's."""
        return is_tensor_parallel_hook(hook)

    # -- tensor parallelism composed beside the strategy (``tensor_parallel.py``) ---------------------
    def check_composed(self, module: nn.Module) -> None:
        """Raise, at tiling, for a layout composed beside this backend that the library was not checked on."""
        problem = composed_problem(module)
        if problem:
            raise UnsupportedBackendError(problem)

    def local_view(self, module: nn.Module, params: Sequence[torch.Tensor]) -> Optional[Any]:
        """How the gated fast kernel sees one call on local tensors: None for plain tensors, else a view with
        ``why_not``, ``enter``, ``params`` and ``leave`` (``tiled_core/local_view.py``)."""
        return tensor_parallel_view(module, params)

    def per_shard_problem(self, module: nn.Module, token_dims: int) -> str:
        """Why running the module's own forward once per token shard would not compute one call ("" where it would)."""
        return per_shard_problem(module, token_dims)

    # -- the loss's head (``tiled_core/head_call.py``) ------------------------------------------------
    def is_head_call_hook(self, lm_head: nn.Module, hook) -> bool:
        """Is this hook on the head the backend's own, which may surround the tiled loss run as one call of it?"""
        return self.is_backend_hook(hook)

    def head_call_gathers(self, lm_head: nn.Module) -> bool:
        """Do the backend's hooks on the head make its sharded parameters whole for the head's call?"""
        return False

    def head_call_sees_graph(self, lm_head: nn.Module) -> bool:
        """May the backend's hooks on the head see the hidden states, graph and all, as that call's input?"""
        return True

    def head_weight_is_whole(self, lm_head: nn.Module) -> bool:
        """Does the head's weight hold the whole vocabulary? Not a DeepSpeed AutoTP layer gathering the logits."""
        from .deepspeed_autotp import gathers_logits  # that file's strategy is built on this class

        return not gathers_logits(lm_head)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({shown})"


class SequenceParallelAware:
    """Mixin for a backend that says how its gradient reduction treats a sequence-parallel group: a loss split
    across it hands each rank the factor that reduction turns into the whole sequence's gradient
    (``tiled_core/sequence_group.py``), the group's size where it averages over those ranks, 1 where it sums.
    Every registered strategy with it is asked; one in play without it is refused (``resolver.py``)."""

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:  # noqa: B027 - optional: most check nothing
        """Raise where this backend, as set up for ``module``'s model, cannot carry a loss split across ``group``."""

    def sums_over_sequence_ranks(self, module: nn.Module, group: Any = None) -> bool:
        """Does the backend *sum* the model's gradients over ``group``'s ranks (checking ``group`` first)?"""
        if group is not None:
            self.check_sequence_group(module, group)
        return False


class WaitsForEveryParameter:
    """Mixin for a backend whose reducer waits for a gradient of every parameter reachable from the output
    (DDP's reducer, FSDP2's reduce-scatter, ZeRO's buckets): an unused one gets zeros, delivered once."""

    unused_grads_as_zeros: ClassVar[bool] = True


@dataclass(frozen=True)
class VocabSlice:
    """What a strategy that splits a head's vocabulary over ranks hands the tiled loss
    (``tiled_core/kernels/vocab_parallel.py``): this rank's view of the head, as plain local tensors."""

    hidden: torch.Tensor  #: ``[..., tokens, hidden]``; its gradient is this rank's part of a sum over ``group``
    weight: torch.Tensor  #: ``[rows, hidden]``, this rank's rows, a view whose gradient reaches the parameter
    bias: Optional[torch.Tensor]  #: ``[rows]`` or None, likewise
    group: Any  #: the process group the vocabulary is split over
    start: int  #: the vocabulary id of this rank's first row
    vocab_size: int  #: the whole vocabulary
    max_rows: int  #: the most rows any rank of ``group`` holds
