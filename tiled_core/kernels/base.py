"""The kernel base classes: what one token shard computes, with a default for everything optional
(docs/architecture.md, "Adding a kernel", whose example runs as a test).

Shards are 2-D ``[shard_tokens, features]`` rows; ``tensors`` are the sharded Function's: ``params`` (by default
every parameter of the module, in ``module.parameters()`` order), then any other tensor the forward was found to
read. A kernel computes with exactly these. The library owns every buffer: a kernel *returns* a shard's output
and gradients, so none can be left unwritten; a built-in kernel that writes into the rows it is offered
(``forward_into``, ``backward_into``) returns those very rows, and nothing is copied.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, List, Optional, Sequence, Tuple

import torch
from torch import nn

if TYPE_CHECKING:
    from ..sharded_autograd import GradAccumulator

NO_MODULE_TYPE = "{kernel}: set module_type (the class of module it runs) or override why_not"
GRAD_COUNT_ERROR = (
    "kernel {kernel!r} for {module}: backward_shard returned {got} gradients for {want} tensors; return one per "
    "tensor it was given (None where a tensor got none)."
)


class ShardKernel:
    """A token-wise computation run one shard at a time, recomputed in backward."""

    #: The name ``register_kernel(Cls)`` registers it under, and ``TiledMLP(m, path=name)`` asks for.
    name: str = ""
    #: The modules it runs (``isinstance``), where the default ``why_not`` decides.
    module_type: Optional[type] = None
    #: Whether the forward may read tensors besides the input and ``params`` (then they are found, made
    #: inputs of the Function, and the recompute must read the same ones: ``remember_reads``).
    may_read_other_tensors: bool = False
    #: Whether a shard's forward may draw random numbers, whose RNG state the recompute replays.
    replays_rng: bool = True
    #: Whether the kernel computes on plain local tensors (a strategy's local view) where parameters are distributed.
    runs_on_local_view: bool = False
    #: Stateless: one built kernel may run every call of a plan.
    serves_many_calls: bool = False
    #: Whether the module's own slots must hold ``tensors`` around the recompute (``using``).
    substitutes_tensors: bool = False

    def __init__(self, module: nn.Module):
        self.module_name = type(module).__name__
        #: Every parameter the module owns, trained or not: never mistaken for another tensor the forward reads.
        self.owned_params: List[torch.Tensor] = list(module.parameters())
        #: The tensors the Function takes as inputs and returns gradients for, in order. The library refuses a
        #: list that leaves out one the module trains (its gradient would be lost).
        self.params: List[torch.Tensor] = self.owned_params

    @classmethod
    def why_not(cls, call: Any) -> str:
        """"" where the kernel runs ``call`` (a ``KernelCall``), else why not."""
        if cls.module_type is None:
            return NO_MODULE_TYPE.format(kernel=cls.__name__)
        return "" if isinstance(call.module, cls.module_type) else f"not a {cls.module_type.__name__}"

    # -- the simple form: return what the shard computes ------------------------------------------------------
    def forward_shard(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shard's output rows (no graph is kept: autograd is off)."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward_shard")

    def backward_shard(self, x: torch.Tensor, grad_out: torch.Tensor, tensors: Sequence[torch.Tensor]
                       ) -> Tuple[Optional[torch.Tensor], Sequence[Optional[torch.Tensor]]]:
        """(the shard's input gradient, one gradient per tensor: None where a tensor got none)."""
        raise NotImplementedError(f"{type(self).__name__} defines no backward_shard")

    # -- the buffer form the sharded Function calls (built-in kernels write in place) ----------------------------
    def output_width(self, tensors: Sequence[torch.Tensor]) -> Optional[int]:
        """The output's width where it is known before the first shard and its dtype is the input's (the
        Function then allocates the whole output first); None: taken from the first shard's output."""
        return None

    def forward_into(self, x: torch.Tensor, out: Optional[torch.Tensor], tensors: Sequence[torch.Tensor],
                     shard: slice) -> torch.Tensor:
        """The shard's output, written into ``out`` (its rows of the call's output) or returned (then copied)."""
        return self.forward_shard(x, tensors)

    def backward_into(self, x: torch.Tensor, grad_out: torch.Tensor, grad_in: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor], shard: slice) -> Optional[torch.Tensor]:
        """The shard's input gradient (``grad_in`` itself where written into it; None only where ``grad_in`` is
        None); the tensors' gradients added to ``grads``."""
        dx, tensor_grads = self.backward_shard(x, grad_out, tensors)
        if len(tensor_grads) != len(tensors):
            raise RuntimeError(GRAD_COUNT_ERROR.format(kernel=self.name, module=self.module_name,
                                                       got=len(tensor_grads), want=len(tensors)))
        for index, grad in enumerate(tensor_grads):
            grads.add(index, grad)
        return dx

    def remember_reads(self, tensors: Sequence[torch.Tensor]) -> None:
        """The tensors without a gradient the forward read (only where ``may_read_other_tensors``)."""

    def using(self, tensors: Sequence[torch.Tensor]) -> ContextManager:
        """Inside: the module computes with ``tensors`` (entered only where ``substitutes_tensors``)."""
        return contextlib.nullcontext()


class ReduceKernel:
    """One shard's contribution to a sum (a loss), with its gradients formed at once (``sharded_reduce``)."""

    name: str = ""
    serves_many_calls: bool = False
    runs_on_local_view: bool = False
    replays_rng: bool = False  # formed in forward: nothing is recomputed

    def __init__(self, params: Sequence[torch.Tensor], module_name: str):
        #: The tensors the Function takes as inputs and returns gradients for, in order.
        self.params: List[torch.Tensor] = list(params)
        self.module_name = module_name

    def compute_tensors(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """What every shard of the call computes with, made once per call (returned, never kept on the kernel)."""
        return tensors

    def shard(self, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, dx: Optional[torch.Tensor],
              grads: Optional[GradAccumulator], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shard's loss times ``scale`` (0-dim); its input gradient into ``dx`` and its parameters' into
        ``grads`` where given (each for the scaled loss)."""
        raise NotImplementedError(f"{type(self).__name__} defines no shard")
