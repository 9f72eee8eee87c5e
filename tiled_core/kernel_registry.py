"""The kernel registry: which per-shard kernel a tiled call runs (docs/architecture.md, "Adding a kernel"). A
call asks the kernels of its shape in priority order and runs the first that applies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from .kernels.base import ShardKernel
from .tensor_reads import describe

MAP = "map"
REDUCE = "reduce"
SHAPES = (MAP, REDUCE)
DEFAULT_PRIORITY = 100
TOKEN_INPUTS_DECLINED = "the call has other sharded inputs besides the hidden states"


@dataclass(slots=True)
class KernelCall:
    """What a kernel is asked about: one call of one module, inside its backend's gathered region
    (the parameters are whole here)."""

    module: nn.Module
    x: torch.Tensor  # the hidden states, ``[..., tokens, hidden]``
    strategy: Any  # the call's ``Strategy``
    trainable: Sequence[torch.Tensor]  # the parameters the backend trains: the ones owed a gradient
    # map: what one shard runs (the module's forward, without its hooks), and other sharded ``[tokens, ...]`` inputs.
    shard_forward: Optional[Callable[..., torch.Tensor]] = None
    token_inputs: Sequence[torch.Tensor] = ()
    options: Any = None  # reduce: the loss's ``CrossEntropyOptions``
    vocab_slice: Any = None  # reduce: this rank's ``VocabSlice`` of a head split over ranks; None: whole here
    # map: the module's call plan; a kernel may keep what it derives from the module in
    # ``cache.kernel_cache[name]``, and guard anything else its answer read (``cache.add_guards``).
    cache: Any = None


class Kernel:
    """A registered kernel: ``why_not`` ("" where it applies), ``build`` the per-shard kernel for such a call."""

    name: str = ""
    shape: str = MAP
    #: map only: the kernel keeps a gradient buffer per trainable parameter beside the module's (the
    #: generic kernel does): the auto shard policy counts those bytes.
    keeps_grad_buffers: bool = True
    #: map only: ``why_not`` answers from the call's plan and the guards it added to it, and ``build`` makes the
    #: same kernel for every such call: the registry may answer for it while the plan holds (docs/architecture.md).
    answers_per_plan: bool = False

    def why_not(self, call: KernelCall) -> str:
        return ""

    def build(self, call: KernelCall) -> Any:
        raise NotImplementedError(f"kernel {self.name!r} does not build a per-shard kernel")


@dataclass(frozen=True)
class KernelChoice:
    """The kernel a call runs (``kernel`` None: none applied) and why each one before it declined."""

    entry: Optional[Kernel]
    kernel: Any
    declined: Tuple[Tuple[str, str], ...]

    @property
    def name(self) -> str:
        return self.entry.name if self.entry is not None else ""

    def describe(self) -> str:
        refusals = "; ".join(f"{name!r} declined: {why}" for name, why in self.declined)
        if self.entry is None:
            return f"no kernel applies ({refusals})"
        return f"kernel {self.name!r}" + (f" ({refusals})" if refusals else "")


_REGISTERED: Dict[str, Tuple[int, int, Kernel]] = {}  # name -> (priority, registration order, kernel)
_ORDERED: Dict[str, Tuple[Kernel, ...]] = {shape: () for shape in SHAPES}
# Counts changes to every registry a call's decision reads (the kernels here; the forward bodies, gated classes,
# equivalent linears and fused activations where they are registered): the call plan keys on it, so a choice
# remembered with a plan holds only for the registrations it was made among.
GENERATION = [0]


def _changed() -> None:
    GENERATION[0] += 1
    for shape in SHAPES:
        entries = sorted((v for v in _REGISTERED.values() if v[2].shape == shape), key=lambda v: (-v[0], v[1]))
        _ORDERED[shape] = tuple(kernel for _, _, kernel in entries)


class ShardKernelEntry(Kernel):
    """The entry of a ``ShardKernel`` subclass registered as it is: built as ``Cls(module)``."""

    def __init__(self, kernel_class: Type[ShardKernel]):
        self.kernel_class = kernel_class
        self.name = kernel_class.name

    def why_not(self, call: KernelCall) -> str:
        if call.token_inputs:
            return TOKEN_INPUTS_DECLINED
        return self.kernel_class.why_not(call)

    def build(self, call: KernelCall) -> ShardKernel:
        return self.kernel_class(call.module)


def register_kernel(kernel: Union[Kernel, Type[ShardKernel]], *, priority: int = DEFAULT_PRIORITY,
                    override: bool = False) -> Kernel:
    """Add ``kernel`` (a ``Kernel`` entry, or a ``ShardKernel`` subclass) to the kernels a tiled call of its
    shape asks, at ``priority`` (higher first; ties in order of registration). Returns its entry. A taken
    name needs ``override=True``."""
    if isinstance(kernel, type) and issubclass(kernel, ShardKernel):
        kernel = ShardKernelEntry(kernel)
    if not isinstance(kernel, Kernel):
        raise TypeError(f"register_kernel takes a Kernel instance or a ShardKernel subclass, got {kernel!r}")
    if not isinstance(kernel.name, str) or not kernel.name:
        raise ValueError(f"{type(kernel).__name__} has no name: set the class attribute `name`")
    if kernel.shape not in SHAPES:
        raise ValueError(f"kernel {kernel.name!r}: shape must be one of {SHAPES}, got {kernel.shape!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {priority!r}")
    if kernel.name in _REGISTERED and not override:
        raise ValueError(f"a kernel named {kernel.name!r} is registered already; pass override=True to replace it")
    _REGISTERED[kernel.name] = (priority, GENERATION[0], kernel)
    _changed()
    return kernel


def unregister_kernel(name: str) -> None:
    """Remove the kernel registered as ``name``."""
    if name not in _REGISTERED:
        raise KeyError(f"no kernel named {name!r}; registered: {available_kernels()}")
    del _REGISTERED[name]
    _changed()


def available_kernels(shape: Optional[str] = None) -> List[str]:
    """The registered kernels' names in the order a call asks them (of one shape, or map then reduce)."""
    shapes = SHAPES if shape is None else (shape,)
    return [kernel.name for s in shapes for kernel in _ORDERED[s]]


def choose_kernel(shape: str, call: KernelCall, only: Optional[str] = None) -> KernelChoice:
    """The first kernel of ``shape`` that applies to ``call`` (only the one named ``only``, when given: the others
    decline as not asked for), built for it; remembered with the call's plan where it may (``answers_per_plan``)."""
    plan = call.cache
    key = None if plan is None else (GENERATION[0], shape, only, call.x.dim(), not call.token_inputs)
    declined: List[Tuple[str, str]] = []
    per_plan = key is not None
    for entry in _ORDERED[shape]:
        if only is not None and entry.name != only:
            declined.append((entry.name, f"path={only!r} was asked for"))
            continue
        per_plan = per_plan and entry.answers_per_plan
        why = entry.why_not(call)
        if not why:
            choice = KernelChoice(entry, entry.build(call), tuple(declined))
            check_declared_tensors(entry.name, choice.kernel, call.module, call.trainable)
            if per_plan and choice.kernel.serves_many_calls:
                plan.choices[key] = choice
            return choice
        declined.append((entry.name, why))
    return KernelChoice(None, None, tuple(declined))


UNDECLARED_TENSORS_ERROR = (
    "kernel {kernel!r} for {module}: its params leave out tensors the module trains ({names}), whose gradients "
    "would be lost. List every trainable tensor the kernel computes with in params (by default: all of "
    "module.parameters())."
)


def check_declared_tensors(name: str, kernel: Any, module: nn.Module, trainable: Sequence[torch.Tensor]) -> None:
    """Refuse, before any work, a kernel whose ``params`` leave out a tensor the module trains."""
    params = kernel.params
    if params is trainable:  # built from this very list (the generic and module-head kernels)
        return
    declared = {id(t) for t in params}
    missing = {id(t) for t in trainable if id(t) not in declared}
    if missing:
        names = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in missing]
        shown = ", ".join(names) or describe([t for t in trainable if id(t) in missing])
        raise ValueError(UNDECLARED_TENSORS_ERROR.format(kernel=name, module=type(module).__name__, names=shown))
