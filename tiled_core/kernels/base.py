"""The kernel base classes: what one token shard computes, with a default for everything optional
(docs/architecture.md, "Adding a kernel", whose example runs as a test). Shards are 2-D ``[shard_tokens,
features]`` rows; ``tensors`` are the Function's: ``params``, then any other tensor the forward was found to
read. A kernel *returns* a shard's output and gradients, so no buffer can be left unwritten.
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

# A parameter's slots: every (owner, attribute) of a module tree holding it (tied: several; none: read otherwise).
# Owner None: the tree's root, given at each use (a layout kept in the root's own plan must not hold it).
Slots = List[List[Tuple[Optional[nn.Module], str]]]
Swapped = List[Tuple[nn.Module, str, Optional[torch.Tensor]]]


def parameter_slots(root: nn.Module, tensors: Sequence[torch.Tensor], root_as_none: bool = False) -> Slots:
    where: dict = {}
    for owner in root.modules():
        for attr, p in owner._parameters.items():
            if p is not None:
                where.setdefault(id(p), []).append((None if root_as_none and owner is root else owner, attr))
    return [where.get(id(t), []) for t in tensors]


def put_in_slots(root: nn.Module, slots: Slots, tensors: Sequence[torch.Tensor], swapped: Swapped) -> None:
    """Each tensor into its slots, as ``functional_call`` does (a slot may hold a plain tensor); what a slot held
    is added to ``swapped`` for ``restore_slots``. ``tensors`` may be longer than ``slots``: the rest have none."""
    for owner_slots, tensor in zip(slots, tensors, strict=False):
        for slot_owner, attr in owner_slots:
            owner = root if slot_owner is None else slot_owner
            held = owner._parameters[attr]
            if held is not tensor:
                swapped.append((owner, attr, held))
                owner._parameters[attr] = tensor  # type: ignore[assignment]


def restore_slots(swapped: Swapped) -> None:
    for owner, attr, held in reversed(swapped):
        owner._parameters[attr] = held  # type: ignore[assignment]


def hookless_stand_ins(tensors: Sequence[torch.Tensor], eligible: Sequence[bool]) -> List[torch.Tensor]:
    """``tensors``, each eligible one that requires grad as a stand-in: a new leaf on its memory and version counter,
    without its tensor hooks (a tensor twice, tied, gets one). ``autograd.grad`` hands each input's gradient to that
    input's hooks: taken per shard against a parameter itself, every shard's part would pass its hooks (a gradient
    multiplier, clipping, logging) and the sum autograd delivers would pass them again; against the stand-in, only
    the sum does, once, as untiled."""
    made: dict = {}
    out = list(tensors)
    for index, (tensor, ok) in enumerate(zip(tensors, eligible, strict=True)):
        if ok and tensor.requires_grad:
            if id(tensor) not in made:
                made[id(tensor)] = tensor.detach().requires_grad_()
            out[index] = made[id(tensor)]
    return out


def grads_via_stand_ins(output: torch.Tensor, grad_output: torch.Tensor, leading: Sequence[torch.Tensor],
                        stand_ins: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], wanted: Sequence[int],
                        grads: Optional[GradAccumulator]) -> List[Optional[torch.Tensor]]:
    """``autograd.grad`` of ``output`` for ``leading`` (the shard's input, where it needs one) and for each ``wanted``
    tensor, added into ``grads``; returns the leading tensors' gradients. A tensor is asked for through its stand-in
    and, where it has one, as itself too: code that reads it other than through its slot (a reference kept in a list
    or a closure) reaches it; unread, asking costs nothing and its hooks do not run."""
    replaced = [index for index in wanted if stand_ins[index] is not tensors[index]]
    inputs = [*leading, *(stand_ins[index] for index in wanted), *(tensors[index] for index in replaced)]
    found = torch.autograd.grad(output, inputs, grad_output, allow_unused=True)
    for index, grad in zip((*wanted, *replaced), found[len(leading):], strict=True):
        grads.add(index, grad)  # type: ignore[union-attr]  # given wherever a tensor is wanted
    return list(found[:len(leading)])


class ShardKernel:
    """A token-wise computation run one shard at a time, recomputed in backward."""

    name: str = ""  # what ``register_kernel(Cls)`` registers it under and ``TiledMLP(m, path=name)`` asks for
    module_type: Optional[type] = None  # the modules it runs (``isinstance``), where the default ``why_not`` decides
    # The forward may read tensors besides the input and ``params``: they are found, made inputs of the Function,
    # and the recompute must read the same ones (``remember_reads``).
    may_read_other_tensors: bool = False
    replays_rng: bool = True  # a shard may draw random numbers, whose RNG state the recompute replays
    runs_on_local_view: bool = False  # computes on plain local tensors where parameters are distributed
    serves_many_calls: bool = False  # stateless: one built kernel may run every call of a plan
    substitutes_tensors: bool = False  # the module's own slots must hold ``tensors`` around the recompute (``using``)

    def __init__(self, module: nn.Module):
        self.module_name = type(module).__name__
        # Every parameter the module owns, trained or not: never mistaken for another tensor the forward reads.
        self.owned_params: List[torch.Tensor] = list(module.parameters())
        # The Function's tensors, in order; a list that leaves out one the module trains is refused.
        self.params: List[torch.Tensor] = self.owned_params

    @classmethod
    def why_not(cls, call: Any) -> str:
        """"" where the kernel runs ``call`` (a ``KernelCall``), else why not."""
        if cls.module_type is None:
            return NO_MODULE_TYPE.format(kernel=cls.__name__)
        return "" if isinstance(call.module, cls.module_type) else f"not a {cls.module_type.__name__}"

    def forward_shard(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shard's output rows (no graph is kept: autograd is off)."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward_shard")

    def backward_shard(self, x: torch.Tensor, grad_out: torch.Tensor, tensors: Sequence[torch.Tensor]
                       ) -> Tuple[Optional[torch.Tensor], Sequence[Optional[torch.Tensor]]]:
        """(the shard's input gradient, one gradient per tensor: None where a tensor got none)."""
        raise NotImplementedError(f"{type(self).__name__} defines no backward_shard")

    # The buffer form the shard loops call (built-in kernels write in place).
    def output_width(self, tensors: Sequence[torch.Tensor]) -> Optional[int]:
        """The output's width where known before the first shard, in the input's dtype (None: from the first shard)."""
        return None

    def forward_into(self, x: torch.Tensor, out: Optional[torch.Tensor], tensors: Sequence[torch.Tensor],
                     shard: slice) -> torch.Tensor:
        """The shard's output, written into ``out`` (its rows of the call's output) or returned (then copied)."""
        return self.forward_shard(x, tensors)

    def backward_into(self, x: torch.Tensor, grad_out: torch.Tensor, grad_in: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor], shard: slice) -> Optional[torch.Tensor]:
        """The shard's input gradient (None only where ``grad_in`` is None); the tensors' added to ``grads``."""
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
        self.params: List[torch.Tensor] = list(params)
        self.module_name = module_name

    def compute_tensors(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """What every shard of the call computes with, made once per call (never kept on the kernel)."""
        return tensors

    def shard(self, x: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, dx: Optional[torch.Tensor],
              grads: Optional[GradAccumulator], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The shard's loss times ``scale`` (0-dim); its input gradient into ``dx`` and its parameters' into
        ``grads`` where given (each for the scaled loss)."""
        raise NotImplementedError(f"{type(self).__name__} defines no shard")
