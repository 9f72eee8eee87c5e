"""Generic per-shard kernel: any token-wise module, recomputed with autograd in backward, its gradients
taken with ``torch.autograd.grad`` for whichever of the Function's tensors need one (LoRA, frozen parts)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..collectives import is_pending, wait_pending
from ..plain_values import PlainValues, snapshot
from ..sharded_autograd import capture_rng_state, replay_rng_state
from ..tensor_reads import TensorReads, describe, next_sequence_nr
from .base import (
    ShardKernel,
    Slots,
    Swapped,
    grads_via_stand_ins,
    hookless_stand_ins,
    parameter_slots,
    put_in_slots,
    restore_slots,
)

if TYPE_CHECKING:
    from ..sharded_autograd import GradAccumulator

HOOKS_CHANGED_ERROR = (
    "TiledMLP: the hooks on submodules of {module} changed between its forward and backward ({hooks}). The "
    "backward recomputes the forward through the submodules, so it would not compute what the forward did. "
    "Add or remove hooks before a forward, not between it and its backward."
)
WRAPPED_OUTPUT_ERROR = (
    "TiledMLP: {module} returned a {kind}, a tensor subclass that wraps others (a DTensor: a tensor-parallel layer "
    "with use_local_output=False last). The tiled call's output is one plain tensor that each shard's values are "
    "copied into, which is not what the module returns. Return a plain tensor (use_local_output=True on the last "
    "layer's style), or leave the module untiled"
)
EXTERNAL_TENSOR_ERROR = (
    "TiledMLP: the backward recompute of {module} read tensors that require grad but were not read by its "
    "forward: {tensors}. Their gradients would be lost. Keep the tensors a forward reads fixed until its "
    "backward, or register them as parameters of the module."
)
CHILD_REPLACED_ERROR = (
    "TiledMLP: submodules of {module} were replaced, added or removed between its forward and backward ({names}). "
    "The backward recomputes the forward through the submodules, so it would not compute what the forward did. "
    "Change submodules before a forward, not between it and its backward."
)
CHANGED_READ_ERROR = (
    "TiledMLP: a tensor the forward of {module} read without a gradient changed between its forward and its "
    "backward ({what}: {tensors}). The backward recomputes the forward, so it would use other values than the "
    "forward did and its gradients would be wrong (a conditioning tensor set per micro-batch, with two forwards "
    "before their backwards, does this). Keep such a tensor fixed until the backward of each forward that read "
    "it, or pass it as an input."
)


@dataclass(frozen=True)
class GenericLayout:
    """What the generic kernel reads of the module's structure, once per call plan."""

    slots: Slots  # per parameter (``parameter_slots``, the module itself as None)
    children: Tuple[Tuple[str, nn.Module], ...]  # the submodules the forward runs through, by name
    owned_params: List[torch.Tensor]  # trained or not: never mistaken for another tensor the forward reads
    hooks: List[str]  # the submodule hooks the forward runs with; the recompute must run the same ones
    plain_values: PlainValues  # what the recompute must find unchanged (``self.scale``, PEFT's active adapter)


def generic_layout(module: nn.Module, params: Sequence[torch.Tensor], hooks: List[str],
                   instance_forward: Optional[Callable] = None) -> GenericLayout:
    """``instance_forward``: what the module's forward runs where it is not its class's."""
    return GenericLayout(parameter_slots(module, params, root_as_none=True), _children(module),
                         list(module.parameters()), hooks, PlainValues(snapshot(module, instance_forward)))


def _children(module: nn.Module) -> Tuple[Tuple[str, nn.Module], ...]:
    return tuple(module.named_modules())[1:]


def _same(packed: torch.Tensor) -> torch.Tensor:
    return packed


class _ReadAsStandIns(TorchFunctionMode):
    """Hands every torch call the stand-ins of the tensors a forward reads outside the module's parameter slots (a
    weight in a closure or a plain attribute), by identity; one level of lists and tuples, as ``TensorReads`` sees."""

    def __init__(self, stand_ins: Dict[int, torch.Tensor]):
        super().__init__()
        self._by_id = stand_ins

    def _swap(self, value: Any) -> Any:
        by_id = self._by_id
        if isinstance(value, torch.Tensor):
            return by_id.get(id(value), value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) and id(v) in by_id for v in value):
            swapped = [by_id.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in value]
            return swapped if isinstance(value, list) else tuple(swapped)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*map(self._swap, args), **{k: self._swap(v) for k, v in (kwargs or {}).items()})


class GenericShardKernel(ShardKernel):
    name = "generic"
    may_read_other_tensors = True
    substitutes_tensors = True

    def __init__(self, module: nn.Module, forward_fn: Callable, params: List[torch.Tensor], shard_prefix: tuple,
                 layout: GenericLayout, current_hooks: Callable[[], List[str]], grad_mode: bool = True,
                 token_inputs: Sequence[torch.Tensor] = ()):
        # Built for one call, and kept by its graph only: the module stays alive until its backward.
        self.module = module
        self.forward_fn = forward_fn
        # Other sharded inputs (a MoE block's routing), sliced like x; found as any other tensor the forward reads.
        self.token_inputs = tuple(token_inputs)
        self.grad_mode = grad_mode  # the caller's: a forward branching on it computes what its recompute does
        self._forward_reads: Optional[List[Tuple[torch.Tensor, int]]] = None  # (tensor, version)
        self.module_name = type(module).__name__
        self.params = params
        self.owned_params = layout.owned_params
        self._layout = layout
        self._current_hooks = current_hooks  # read again in backward, against the forward's
        self._plain_values = layout.plain_values  # or those the first shard left (``_first_shard_again``)
        self._first_shard_done = False
        self.shard_prefix = shard_prefix  # leading 1s: each shard has the rank of the caller's input (MoE blocks)
        self._reads_checked = False
        # Inside ``using``: the slots it changed (restored at its exit), and the backward's stand-ins once made.
        self._swapped: Optional[Swapped] = None
        self._stand_ins: Optional[List[torch.Tensor]] = None
        self._read_elsewhere: Optional[_ReadAsStandIns] = None  # for the tensors without a slot, where any

    def _run(self, x_shard: torch.Tensor, shard: Optional[slice]) -> torch.Tensor:
        token_inputs: Tuple[torch.Tensor, ...] = ()
        if self.token_inputs:
            assert shard is not None, "a kernel with token inputs needs each shard's token slice"
            token_inputs = tuple(r[shard].view(*self.shard_prefix, -1, *r.shape[1:]) for r in self.token_inputs)
        y = self.forward_fn(x_shard.view(*self.shard_prefix, *x_shard.shape), *token_inputs)
        if not isinstance(y, torch.Tensor):
            raise TypeError(
                f"TiledMLP's generic path needs a module that returns one tensor, got {type(y).__name__}; "
                "wrap the module so that it returns only the hidden states"
            )
        if getattr(type(y), "__tensor_flatten__", None) is not None and not is_pending(y):
            raise TypeError(WRAPPED_OUTPUT_ERROR.format(module=self.module_name, kind=type(y).__name__))
        if y.shape[:-1] != (*self.shard_prefix, x_shard.shape[0]):
            raise ValueError(
                f"TiledMLP needs a token-wise module ([..., tokens, hidden] -> [..., tokens, out]), but a shard "
                f"of shape {tuple(x_shard.shape)} gave an output of shape {tuple(y.shape)}"
            )
        return y.reshape(x_shard.shape[0], y.shape[-1])

    def forward_into(self, x_shard: torch.Tensor, out_shard: Optional[torch.Tensor],
                     tensors: Sequence[torch.Tensor], shard: Optional[slice] = None) -> torch.Tensor:
        # A graph built here dies with ``y``. Its saved tensors stay its own, detached (a tensor saving its own
        # output would make a cycle): an outer saved-tensor hook (a checkpoint, an offload) must not see them.
        with torch.set_grad_enabled(self.grad_mode), torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, _same):
            if self._first_shard_done:
                # With a graph or without: a value changed by the first shard would reach every later
                # shard and not the first, one output computed by several functions.
                y = self._run(x_shard, shard)
            else:
                self._first_shard_done = True
                rng_state = capture_rng_state(x_shard.device)
                y = self._run(x_shard, shard)
                if self._plain_values.changed():
                    del y  # its graph: one shard's activations at a time, the re-run's included
                    y = self._first_shard_again(x_shard, shard, rng_state)
        return y.detach()

    def _first_shard_again(self, x_shard: torch.Tensor, shard: Optional[slice], rng_state: tuple) -> torch.Tensor:
        """The first shard changed a value the code reads (a one-time set-up flag: bitsandbytes'
        ``compute_type_is_set``), which every later shard and recompute reads: so it runs again with that value
        and its random numbers. A forward that changes the value at every call is refused, before any work."""
        before = self._plain_values
        self._plain_values = PlainValues(before.read)
        with replay_rng_state(x_shard.device, rng_state):
            y = self._run(x_shard, shard)
        self._plain_values.check_settled(self.module_name, before)
        return y

    def remember_reads(self, tensors: Sequence[torch.Tensor]) -> None:
        self._forward_reads = [(t, t._version) for t in tensors]

    @contextlib.contextmanager
    def using(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The module's parameter slots hold the Function's tensors for the recompute (as ``functional_call``)."""
        self._plain_values.check(self.module_name)
        now = self._current_hooks()
        if now != self._layout.hooks:
            changed = sorted(set(now) ^ set(self._layout.hooks))
            raise RuntimeError(HOOKS_CHANGED_ERROR.format(module=self.module_name, hooks=", ".join(changed)))
        children = _children(self.module)
        if children != self._layout.children:  # tuples of (name, module): compared by identity first
            changed = sorted({name for name, _ in set(children) ^ set(self._layout.children)})
            raise RuntimeError(CHILD_REPLACED_ERROR.format(module=self.module_name, names=", ".join(changed)))
        self._reads_checked = False  # once per backward (a retained graph runs several)
        swapped: Swapped = []
        outer = self._swapped, self._stand_ins, self._read_elsewhere
        self._swapped, self._stand_ins, self._read_elsewhere = swapped, None, None
        try:
            # The tensors after the parameters (found reading the forward) have no slot: ``slots`` is shorter.
            put_in_slots(self.module, self._layout.slots, tensors, swapped)
            yield
        finally:
            restore_slots(swapped)
            self._swapped, self._stand_ins, self._read_elsewhere = outer

    def _stand_ins_for(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The backward's tensors, each one that needs a gradient as a stand-in (``hookless_stand_ins``), put in
        its slots; made once per backward, inside ``using``. The tensors after the parameters (found reading the
        forward) have no slot: their stand-ins are handed to each torch call that reads them (``_ReadAsStandIns``),
        entered only where there are any."""
        if self._stand_ins is not None:
            return self._stand_ins
        assert self._swapped is not None, "the generic kernel's backward runs inside using()"
        slots = self._layout.slots
        slotted = [index >= len(slots) or bool(slots[index]) for index in range(len(tensors))]
        stand_ins = hookless_stand_ins(tensors, slotted)
        elsewhere = {id(t): s for t, s in zip(tensors[len(slots):], stand_ins[len(slots):], strict=True) if s is not t}
        put_in_slots(self.module, slots, stand_ins, self._swapped)
        self._stand_ins = stand_ins
        self._read_elsewhere = _ReadAsStandIns(elsewhere) if elsewhere else None
        return stand_ins

    def backward_into(self, x_shard: torch.Tensor, grad_out_shard: torch.Tensor, grad_in_shard: Optional[torch.Tensor],
                      grads: GradAccumulator, tensors: Sequence[torch.Tensor],
                      shard: Optional[slice] = None) -> Optional[torch.Tensor]:
        wanted = [i for i, need in enumerate(grads.needed) if need]
        stand_ins = self._stand_ins_for(tensors)
        elsewhere = self._read_elsewhere
        # Entered before the first shard's ``TensorReads``, which so sees the tensors themselves, as in the forward.
        with torch.enable_grad(), elsewhere if elsewhere is not None else contextlib.nullcontext():
            x_leaf = x_shard.detach().requires_grad_(grad_in_shard is not None)
            y = self._recompute(x_leaf, [*stand_ins, *tensors], shard)
        # A collective in the forward runs again here: its work stays registered until waited for.
        wait_pending(y)
        leading = [x_leaf] if grad_in_shard is not None else []
        if not (leading or wanted) or not y.requires_grad:
            return None if grad_in_shard is None else grad_in_shard.zero_()
        # Code reading a tensor deeper than ``_ReadAsStandIns`` looks reaches the tensor itself (``grads_via_stand_ins``).
        found = grads_via_stand_ins(y, grad_out_shard, leading, stand_ins, tensors, wanted, grads)
        if grad_in_shard is None:
            return None
        return grad_in_shard.zero_() if found[0] is None else found[0]

    def _recompute(self, x_leaf: torch.Tensor, known: Sequence[torch.Tensor], shard: Optional[slice]) -> torch.Tensor:
        if self._reads_checked:
            return self._run(x_leaf, shard)
        # Once per call: no tensor needing a gradient that the forward did not read (autograd.grad would skip
        # it), and the same tensors without one as the forward, unchanged.
        reads = TensorReads(known=[x_leaf, *known, *self.owned_params], made_since=next_sequence_nr(),
                            grad_only=False, watch_kept=True)
        with reads:
            y = self._run(x_leaf, shard)
        self._reads_checked = True
        foreign = reads.foreign_tensors()
        needing = [t for t in foreign if t.requires_grad]
        if needing:
            raise RuntimeError(EXTERNAL_TENSOR_ERROR.format(module=self.module_name, tensors=describe(needing)))
        self._check_same_reads([t for t in foreign if not t.requires_grad])
        return y

    def _check_same_reads(self, now: List[torch.Tensor]) -> None:
        then = self._forward_reads
        if then is None:
            return  # the forward ran without a graph being built: nothing was recorded to compare
        then_ids, now_ids = {id(t) for t, _ in then}, {id(t) for t in now}
        # A tensor read now equal, exactly, to one the forward read and no longer does is fine (a parent that
        # rebuilds the same conditioning in a checkpoint's recompute).
        unmatched = [t for t, _ in then if id(t) not in now_ids]
        for tensor in (t for t in now if id(t) not in then_ids):
            twin = next((u for u in unmatched if u.shape == tensor.shape and u.dtype == tensor.dtype
                         and u.device == tensor.device and torch.equal(u, tensor)), None)
            if twin is None:
                raise RuntimeError(CHANGED_READ_ERROR.format(module=self.module_name, what="another tensor is read now",
                                                             tensors=describe([tensor])))
            unmatched.remove(twin)
        changed = [t for t, version in then if t._version != version]
        if changed:
            raise RuntimeError(CHANGED_READ_ERROR.format(module=self.module_name, what="modified in place",
                                                         tensors=describe(changed)))
