"""The contract between the backend-neutral core and a parallel backend (docs/architecture.md, "Adding a
strategy"): ``claims`` is required, every other member has a default or is declared."""
from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, List, Optional, Sequence, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from .hf_tensor_parallel import version_problem
from .tensor_parallel import is_tensor_parallel_hook, local_numel, per_shard_problem, tensor_parallel_view

_DISTRIBUTED_BUILT = dist.is_available()


def process_group_ready() -> bool:
    return _DISTRIBUTED_BUILT and dist.is_initialized()


ClaimsFunction = TypeVar("ClaimsFunction", bound=Callable[..., bool])


def claims_need_process_group(claims: ClaimsFunction) -> ClaimsFunction:
    """Decorates a ``claims`` (under ``@classmethod``) that can only answer yes on an initialised process group:
    without one it answers False without being asked."""
    @functools.wraps(claims)
    def claims_where_a_process_group_is(cls: Any, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        return process_group_ready() and claims(cls, module, ancestors)

    return cast(ClaimsFunction, claims_where_a_process_group_is)


class UnsupportedBackendError(RuntimeError):
    """The module runs under a backend (or a backend configuration) that TiledMLP cannot tile."""


def check_spans_sequence_group(backend: str, model: nn.Module, backend_ranks, group, fix: str) -> None:
    sp_ranks = sorted(dist.get_process_group_ranks(group))
    if not set(sp_ranks) <= set(backend_ranks):
        raise UnsupportedBackendError(
            f"sequence parallelism: {backend} averages the gradients of {type(model).__name__} over ranks "
            f"{sorted(backend_ranks)}, which do not include every rank {sp_ranks} of the sequence-parallel group: "
            f"each SP rank's share of the sequence would never be added to the others'. {fix}")


# Each declared capability: the flag, and the method a class sets it with.
CAPABILITIES = (("gathers_params", "gathered"), ("delivers_grads", "deliver_grads"),
                ("configures_from_runtime", "configured_for"))


def check_declarations(obj: Any) -> None:
    """Refuse a class, or an instance (a method set on it), whose capability flags and methods disagree."""
    cls = obj if isinstance(obj, type) else type(obj)
    for flag, method in CAPABILITIES:
        own, base = getattr(obj, method), getattr(Strategy, method)
        defined = getattr(own, "__func__", own) is not getattr(base, "__func__", base)
        if defined and not getattr(obj, flag):
            raise TypeError(f"{cls.__name__} defines {method} but does not declare {flag} = True: the tiled call "
                            f"uses {method} only where the class declares it. Set {flag} = True on {cls.__name__}")
        if getattr(obj, flag) and not defined and obj is cls:  # an instance's flag comes from its class
            raise TypeError(f"{cls.__name__} declares {flag} = True but does not define {method}: define "
                            f"{method}, or leave {flag} False")


class Strategy(ABC):
    #: Registry key, also accepted as ``TiledMLP(strategy=name)``.
    name: str = ""
    #: The resolver asks the highest priority first; the single-device fallback has the lowest.
    priority: ClassVar[int] = 0
    gathers_params: ClassVar[bool] = False
    delivers_grads: ClassVar[bool] = False
    configures_from_runtime: ClassVar[bool] = False
    #: ``claims`` reads only the module's layout: "auto" asks it once per layout (``resolver.py``).
    claims_from_layout: ClassVar[bool] = False
    #: Set by ``WaitsForEveryParameter``.
    unused_grads_as_zeros: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declarations(cls)

    @classmethod
    @abstractmethod
    def claims(cls, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> bool:
        """Is ``module`` run by this backend? ``ancestors``: the modules above it, outermost first, where recorded."""

    @classmethod
    def configured_for(cls, module: nn.Module, ancestors: Sequence[nn.Module] = (), **init_kwargs: Any) -> Strategy:
        """The instance that runs ``module`` once this class claimed it; asked at every call."""
        return cls(**init_kwargs)

    def check_supported(self, module: nn.Module) -> None:  # noqa: B027 - optional: most backends refuse nothing
        """Raise a clear error for a configuration this backend cannot tile, before any work."""

    def gathered(self, module: nn.Module) -> ContextManager:
        """Inside: the module's parameters are whole (around the call, and around its recompute)."""
        return contextlib.nullcontext()

    def deliver_grads(self, params: Sequence[torch.Tensor],
                      grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """What autograd accumulates into each of ``params``, given its gradient summed over the shards."""
        return grads

    def trainable_params(self, module: nn.Module) -> List[torch.Tensor]:
        return [p for p in module.parameters() if p.requires_grad]

    def allows_untiled_call(self, module: nn.Module) -> bool:
        """May a call run the plain module instead? Only where both issue the same collectives."""
        return True

    def swaps_param_storage(self, module: nn.Module) -> bool:
        """Does the backend re-gather the parameters between forward and backward (no version check then)?"""
        return False

    def param_bytes(self, module: nn.Module) -> int:
        """Bytes for the auto shard policy: alike on every rank, so that they choose one shard count."""
        return sum(local_numel(p) * p.element_size() for p in module.parameters())

    def is_backend_hook(self, hook) -> bool:
        """Is this hook on a submodule the backend's own, which ``gathered`` or the local view stands in for?"""
        return is_tensor_parallel_hook(hook)

    def check_composed(self, module: nn.Module) -> None:
        """Raise, at tiling, for a tensor-parallel layout beside this backend that the library was not checked on."""
        problem = version_problem(module)
        if problem:
            raise UnsupportedBackendError(problem)

    def local_view(self, module: nn.Module, params: Sequence[torch.Tensor]) -> Optional[Any]:
        """None for plain tensors, else how the kernel sees one call on local tensors (``tiled_core/local_view.py``)."""
        return tensor_parallel_view(module, params)

    def per_shard_problem(self, module: nn.Module, token_dims: int) -> str:
        """Why running the module's forward once per token shard would not compute one call ("" where it would)."""
        return per_shard_problem(module, token_dims)

    def head_call(self, lm_head: nn.Module) -> HeadCall:
        """How the backend takes part in the tiled loss's one call of ``lm_head``."""
        from .deepspeed_autotp import gathers_logits  # that file's strategy is built on this class

        return HeadCall(self.is_backend_hook, weight_is_whole=not gathers_logits(lm_head))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({shown})"


class SequenceParallelAware:
    """Mixin for a backend that says whether its gradient reduction sums (True) or averages (False) over a
    sequence-parallel group's ranks; under SP a strategy in play without it is refused (``resolver.py``)."""

    def check_sequence_group(self, module: nn.Module, group: Any) -> None:  # noqa: B027 - optional: most check nothing
        """Raise where this backend, as set up for ``module``'s model, cannot carry a loss split across ``group``."""

    def sums_over_sequence_ranks(self, module: nn.Module, group: Any = None) -> bool:
        if group is not None:
            self.check_sequence_group(module, group)
        return False


class WaitsForEveryParameter:
    """Mixin for a backend whose reducer waits for a gradient of every parameter reachable from the output
    (DDP's reducer, FSDP2's reduce-scatter, ZeRO's buckets): an unused one gets zeros, delivered once."""

    unused_grads_as_zeros: ClassVar[bool] = True


@dataclass(frozen=True)
class HeadCall:
    """A backend's part in the tiled loss, which runs as one call of the head (``in_head_call`` in ``tiled_core/tiled_loss.py``)."""

    owns_hook: Callable[[Any], bool]  #: is this hook on the head the backend's own, which may surround the loss?
    gathers: bool = False  #: its hooks make whole, inside the call, a head that is sharded outside it
    sees_graph: bool = True  #: its hooks may see the hidden states, graph and all, as the call's input
    weight_is_whole: bool = True  #: the vocabulary can be read from the weight (not AutoTP's gathering head)


@dataclass(frozen=True)
class VocabSlice:
    """This rank's view of a vocabulary-parallel head, as plain local tensors (``LinearHeadKernel`` in ``tiled_core/kernels/lm_head.py``)."""

    hidden: torch.Tensor  #: ``[..., tokens, hidden]``; its gradient is this rank's part of a sum over ``group``
    weight: torch.Tensor  #: ``[rows, hidden]``, this rank's rows, a view whose gradient reaches the parameter
    bias: Optional[torch.Tensor]
    group: Any  #: the process group the vocabulary is split over
    start: int  #: the vocabulary id of this rank's first row
    vocab_size: int
    max_rows: int  #: the most rows any rank of ``group`` holds
