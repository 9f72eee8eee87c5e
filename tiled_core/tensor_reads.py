"""Which tensors a piece of module code reads that it did not make itself (a weight in a plain attribute or a
closure, conditioning set from outside): the tiled forward keeps no graph, so such a tensor must become an input
of the sharded Function or its gradient is lost. A ``TorchFunctionMode`` sees every tensor argument of every
torch call, which is exactly that data flow."""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from . import strict as _strict
from .collectives import is_collective


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    # One level of lists and tuples covers torch.cat/stack/einsum operands.
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a wrapper tensor subclass holds (``__tensor_flatten__``: a ``DTensor``'s local tensor), recursively."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return []
    found: List[torch.Tensor] = []
    for name in flatten(t)[0]:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            found.append(inner)
            found.extend(_inner_tensors(inner))
    return found


class _TensorRef(weakref.ref):
    """A weak reference to one tensor, asked as a storage's is."""

    def expired(self) -> bool:
        return self() is None


Released = Union[StorageWeakRef, _TensorRef]

# Tensors that wrap no others: what most calls make, answered by type before any attribute is read.
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def _storages(t: torch.Tensor) -> List[StorageWeakRef]:
    """Weak references to the memory ``t`` holds: its own storage, or a wrapper subclass's inner tensors'."""
    found = []
    for plain in _inner_tensors(t) or [t]:
        try:
            found.append(StorageWeakRef(plain.untyped_storage()))
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a wrapper itself, or a layout without one storage (sparse)
    return found


class TensorReads(TorchFunctionMode):
    """Records the tensors read by torch calls inside the ``with`` block that are not ``known`` (by identity):
    only those that require grad with ``grad_only``. ``made_since``: an autograd sequence number from which
    tensors were made inside the block. ``watch_kept``: watch what the block makes for ``kept``, in strict mode
    or where ``parametrize.cached()`` is on (its cache would keep the first shard's weight)."""

    def __init__(self, known: Iterable[torch.Tensor], grad_only: bool = True, made_since: Optional[int] = None,
                 watch_kept: bool = False):
        super().__init__()
        watched = watch_kept and (_strict.ON or parametrize._cache_enabled > 0)
        self._made_refs: Optional[List[weakref.ref]] = [] if watched else None
        self._hold_made = not watch_kept  # held where kept tensors are not asked about (their ids stay unique)
        known = list(known)
        self._known = {id(t) for t in known}
        # Where kept tensors are watched, what a collective took or made in the block: ids, and memory by storage.
        self._collective_ids: set = set()
        self._collective_storages: Dict[int, Tuple[StorageWeakRef, str]] = {}
        self._collective_views: Dict[int, Tuple[_TensorRef, str]] = {}
        self._known_tensors = known
        self._grad_only = grad_only
        self._made_since = made_since
        self._made: List[torch.Tensor] = []
        self._made_ids: set = set()
        self.foreign: Dict[int, torch.Tensor] = {}

    def _is_foreign(self, t: torch.Tensor) -> bool:
        if id(t) in self._known or id(t) in self._made_ids or id(t) in self.foreign:
            return False
        if self._grad_only and not t.requires_grad:
            return False
        if t._base is not None and id(t._base) in self._known:
            return False  # a view of a known tensor (an expert's slice ``w[e]`` of a 3-D weight, made before the call)
        node = t.grad_fn
        if node is not None and self._made_since is not None and node._sequence_nr() >= self._made_since:
            return False
        if self._wraps_made_tensors(t):
            self._made_ids.add(id(t))
            return False
        return True

    def _wraps_made_tensors(self, t: torch.Tensor) -> bool:
        """Whether ``t`` wraps (``__tensor_flatten__``) tensors made in the block: a wrapper built by a constructor
        no torch call hands back (``DTensor.from_local`` in a tensor-parallel hook) is never among the outputs."""
        inner = _inner_tensors(t)  # none where ``t`` wraps nothing
        return bool(inner) and all(id(i) in self._made_ids or self._wraps_made_tensors(i) for i in inner)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        inputs = list(_tensors(args, kwargs))
        for t in inputs:
            if self._is_foreign(t):
                self.foreign[id(t)] = t
        out = func(*args, **(kwargs or {}))
        # An in-place op returns its own input (a buffer's ``add_``): that tensor was not made here.
        input_ids = {id(t) for t in inputs}
        outputs = list(_tensors(out if isinstance(out, (list, tuple)) else (out,), None))
        made = [t for t in outputs if id(t) not in input_ids]
        # What a made wrapper holds was made with it (a DTensor op's local result): never a tensor from outside.
        inner = [i for t in made if type(t) not in _PLAIN_TYPES for i in _inner_tensors(t)]
        if self._made_refs is not None:
            # The inner tensors are watched too: a hook can keep a DTensor's local tensor alone.
            self._made_refs.extend(map(weakref.ref, made))
            self._made_refs.extend(map(weakref.ref, inner))
        # Kept alive so that no id is reused, unless kept tensors are watched (then each must be free to die; a
        # stale id can only be another tensor made inside).
        if self._hold_made:
            self._made.extend(made)
        self._made_ids.update(map(id, made))
        self._made_ids.update(map(id, inner))
        if self._made_refs is not None and is_collective(func):
            # Only what was made in the block: a buffer or input a collective writes in place outlives it by right.
            self._record_collective([t for t in (*inputs, *outputs) if id(t) in self._made_ids])
        return out

    def _record_collective(self, tensors: List[torch.Tensor]) -> None:
        for t in tensors:
            self._collective_ids.add(id(t))
            if t._base is not None and id(t._base) not in self._made_ids:
                # A view made here of older memory (the call's input): the memory outlives the block, the view must not.
                self._collective_views.setdefault(id(t), (_TensorRef(t), f"{describe([t])} a collective took"))
                continue
            for storage in _storages(t):
                if storage.cdata not in self._collective_storages:
                    self._collective_storages[storage.cdata] = (storage, f"{describe([t])} a collective took or made")

    def foreign_tensors(self) -> List[torch.Tensor]:
        return list(self.foreign.values())

    def kept(self, expected: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """Tensors made inside the block still alive, besides ``expected`` and their views: something kept them (a
        hook stashing an activation), or a collective's backend holds them for a moment (``held_by_collective``)."""
        allowed = {id(t) for t in expected}
        # Views of the weights (an expert's slice ``w[e]``) hold no activation; torch may keep them alive.
        bases = {id(t._base) for t in expected if t._base is not None} | allowed | self._known
        alive = {}
        for ref in self._made_refs or ():
            t = ref()
            if t is None or id(t) in allowed or id(t) in bases or (t._base is not None and id(t._base) in bases):
                continue
            alive[id(t)] = t
        return list(alive.values())

    def held_by_collective(self, t: torch.Tensor) -> bool:
        """Whether ``t``, made in the block and alive, is a tensor a collective took or made (a reused id can only
        make the caller wait for that tensor too)."""
        return id(t) in self._collective_ids

    def collective_memory(self, expected: Iterable[torch.Tensor] = ()) -> List[Tuple[Released, str]]:
        """The memory a collective in the block took or made that is still alive (besides ``expected``'s and the
        known tensors'), and the views of older memory it took: the backend holds them for a moment, or something
        kept them (a view such as ``AsyncCollectiveTensor.wait()``'s, which no torch function mode is handed)."""
        if not self._collective_storages and not self._collective_views:
            return []
        expected = list(expected)
        allowed = {storage.cdata for t in (*expected, *self._known_tensors) for storage in _storages(t)}
        expected_ids = set(map(id, expected))
        memory: List[Tuple[Released, str]] = [(storage, what) for cdata, (storage, what) in self._collective_storages.items()
                                              if cdata not in allowed and not storage.expired()]
        memory += [(view, what) for view_id, (view, what) in self._collective_views.items()
                   if view_id not in expected_ids and not view.expired()]
        return memory


def next_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get (or a lower one)."""
    probe = torch.empty(0, requires_grad=True)
    with torch.enable_grad():
        node = probe.view(0).grad_fn
    assert node is not None, "a view of a leaf that requires grad has an autograd node"
    return node._sequence_nr() + 1


def describe(tensors: Iterable[torch.Tensor]) -> str:
    parts = []
    for t in tensors:
        kind = "a leaf" if t.grad_fn is None else f"made by {type(t.grad_fn).__name__}"
        parts.append(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor ({kind})")
    return ", ".join(parts)
