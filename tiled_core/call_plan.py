"""What a tiled call decides before it touches a tensor, kept while nothing it rests on changes.

A tiled call needs the trainable parameters, the module's sizes, its hooks, the fast-path decision
(what the forward is, ``gated_forms``) and the kernel chosen (``kernel_registry``). A plan is kept while
three things hold: its configuration (the path asked for and the kernels the module's class allows, the
forward and its code by identity, the form registry's generation, the strategy's type, the input's dtype
and device, autocast: ``plan_config``), a snapshot of the module tree (``module_snapshot``: its parameters,
buffers, submodules, hooks, training modes, settings), compared by identity at every call without building
a key, and the guards a kernel added on what else its answer read (the fast kernel's proof reads classes,
module globals and torch's functions: ``gated_forms.ProofReads``). The
strategy itself is resolved at every call (a model is usually wrapped by its backend after it was
tiled, and a warm-up forward must not pin the single-device fallback); without a process group that
costs a few attribute reads.

Short calls pass through (run the module untiled) before any walk (and drop the plan, keeping only its
sizes, ``PlanSizes``): whether a call is too short to
tile is a memory heuristic (``auto_shards``), never a question of the result, which is the module's
own forward either way. It is answered from the sizes the last plan read, while a shallow key (the
strategy's type, the input's dtype and device, the module's own parameters and children by identity)
still matches, so that a pass-through call costs a few microseconds, not a walk. What the shallow key
misses (a child's weight swapped in place for one of another size) can only move that heuristic, and
only until the next tiled call, which walks the module and re-decides with fresh sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .activations import fused_generation
from .autocast_state import AutocastState
from .gated_forms import registry_generation
from .gated_spec import GatedMLPSpec
from .module_snapshot import ModuleSnapshot


@dataclass
class CallPlan:
    config: tuple  # ``plan_config``
    keep_alive: tuple  # the objects the configuration names by id, so that no id is reused while it is cached
    snapshot: ModuleSnapshot  # the module tree the plan was made from
    shallow: tuple  # ``shallow_key``: what the pass-through decision reuses the plan's sizes on
    trainable: List[torch.Tensor]
    intermediate: Optional[int]
    param_bytes: int
    named_buffers: List[Tuple[str, torch.Tensor]]  # the key names each buffer: the same ones while it holds
    # The fast-path decision, made at the first call that needs it (inside the strategy's gathered
    # context) and kept with the plan.
    fast: Optional[Tuple[Optional[GatedMLPSpec], str]] = None
    fast_kernel: Optional[Any] = field(default=None, repr=False)
    # The proven spec's parameters, read once with the decision: the snapshot fixes them while the plan holds.
    fast_params: Optional[List[torch.Tensor]] = field(default=None, repr=False)
    # The generic kernel's view of the module's structure (``kernels.generic.GenericLayout``).
    generic_layout: Optional[Any] = field(default=None, repr=False)
    # What other registered kernels derive from the module, by kernel name (``kernel_registry``).
    kernel_cache: Dict[str, Any] = field(default_factory=dict, repr=False)
    # The kernel choices the registry remembers for this plan (``kernel_registry.choose_kernel``).
    choices: Dict[tuple, Any] = field(default_factory=dict, repr=False)
    # What kernels' answers read outside the module tree and the configuration, each True while it still
    # holds (``add_guards``): the plan holds only while they all do.
    guards: List[Callable[[], bool]] = field(default_factory=list, repr=False)
    # Whether the last kernel chosen keeps gradient buffers of its own (the auto policy's generic rule).
    generic: bool = False
    # The last tiled decision made from this plan (``call_decision._tiled``): (what it was formed from,
    # the ``CallDecision``).
    last_decision: Optional[tuple] = field(default=None, repr=False)
    _trainable_bytes: Optional[int] = field(default=None, repr=False)
    _sizes: Optional[PlanSizes] = field(default=None, repr=False)

    def add_guards(self, *guards: Callable[[], bool]) -> None:
        """Hold this plan only while each of ``guards`` answers True (checked at every call, with the snapshot)."""
        self.guards.extend(guards)

    @property
    def trainable_bytes(self) -> int:
        if self._trainable_bytes is None:
            self._trainable_bytes = sum(p.numel() * p.element_size() for p in self.trainable)
        return self._trainable_bytes

    def sizes(self) -> PlanSizes:
        sizes = self._sizes
        if sizes is None or sizes.generic != self.generic:  # every other field is fixed with the plan
            sizes = self._sizes = PlanSizes(self.shallow, self.intermediate, self.param_bytes, self.trainable_bytes,
                                            self.generic)
        return sizes


@dataclass(frozen=True)
class PlanSizes:
    """What the auto policy reads of a plan: numbers and ids only. A call that passes through keeps
    these and drops the plan itself, so that no parameter the module has since replaced
    (``load_state_dict(..., assign=True)``) is kept alive by the cache of a module that only runs short
    calls; the next tiled call walks the module again."""

    shallow: tuple
    intermediate: Optional[int]
    param_bytes: int
    trainable_bytes: int
    generic: bool


def shallow_key(module: nn.Module, strategy: Any, x: torch.Tensor) -> tuple:
    """The strategy's type, the input's dtype and device, and the module's own parameters and children
    by identity: read without a walk (the objects are kept alive by the plan's ``keep_alive``)."""
    d = module.__dict__
    return (type(strategy), x.dtype, x.device, tuple(map(id, d["_parameters"].values())),
            tuple(map(id, d["_modules"].values())))


def plan_config(module: nn.Module, strategy: Any, x: torch.Tensor, forward: Any) -> Tuple[tuple, tuple]:
    """(configuration, keep_alive): what a plan for ``module`` called on ``x`` under ``strategy`` rests on
    besides the module tree; ``forward`` is what the module's forward is now (the instance forward, else
    the class's: patched on the class or not)."""
    tiling: Any = module.tiling  # the path asked for and the kernels allowed decide the fast path too
    # The module class's own refusal of the fast kernel (``TiledMLP.tiled_no_fast_path``).
    no_fast_path = type(module).tiled_no_fast_path  # type: ignore[attr-defined]  # set on every tiled class
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)  # ``__code__`` swapped in place
    device = x.device
    # The strategy answers trainable_params and param_bytes: another backend, another plan. (Its type: "auto"
    # may build a new instance at every call, DDP's with the process group of the wrapper running it.)
    config = (tiling.path, tiling.use_fused_kernel, no_fast_path, id(forward), id(code), registry_generation(),
              fused_generation(), type(strategy), x.dtype, device, AutocastState.capture(device).enabled)
    return config, (forward, code)


def plan_holds(plan: CallPlan, config: tuple, module: nn.Module) -> bool:
    """Whether ``plan`` was made for this configuration and for ``module``'s tree as it is now, and every
    guard a kernel added still holds."""
    if plan.config != config or not plan.snapshot.holds(module):
        return False
    for guard in plan.guards:
        if not guard():
            return False
    return True
