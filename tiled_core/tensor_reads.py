"""Which tensors a piece of module code reads that it did not make itself.

A module's forward can read tensors that are neither its input nor its registered parameters: a
weight in a plain attribute or a closure, a tensor a hook adds, FiLM-style conditioning set from
outside. Untiled, autograd gives them gradients. The tiled forward keeps no graph, so such a tensor
must be found and made an input of the sharded Function, or its gradient would be lost silently; one
without a gradient must still be the same, unchanged, when the backward recomputes. A
``TorchFunctionMode`` sees every tensor argument of every torch call, which is exactly that data flow.
"""
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
    # One level of lists and tuples covers torch.cat/stack/einsum operands; deeper nesting does not
    # occur in torch's signatures.
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a wrapper tensor subclass holds (``__tensor_flatten__``, the subclass protocol; a
    ``DTensor``'s local tensor), recursively; none for a plain tensor."""
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


class _TensorRef:
    """A weak reference to one tensor, asked as a storage's is (``expired``)."""

    __slots__ = ("_ref",)

    def __init__(self, t: torch.Tensor):
        self._ref = weakref.ref(t)

    def expired(self) -> bool:
        return self._ref() is None


# What the bounded wait polls: a storage's weak reference, or one tensor's.
Released = Union[StorageWeakRef, _TensorRef]

# Tensors that wrap no others: what most calls make, answered by type before any attribute is read.
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


def _storages(t: torch.Tensor) -> List[StorageWeakRef]:
    """Weak references to the memory ``t`` holds: its own storage, or a wrapper subclass's inner tensors'
    (a ``DTensor`` has none of its own)."""
    found = []
    for plain in _inner_tensors(t) or [t]:
        try:
            found.append(StorageWeakRef(plain.untyped_storage()))
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a wrapper itself, or a layout without one storage (sparse)
    return found


class TensorReads(TorchFunctionMode):
    """Records the tensors read by torch calls inside the ``with`` block that are not ``known``.

    Args:
        known: tensors the caller accounts for (the input, the parameters), compared by identity.
        grad_only: record only tensors that require grad (what would lose a gradient); else every
            tensor read (what the fast path would skip), with the tensors made inside excluded.
        made_since: a tensor whose autograd node was created at or after this sequence number was made
            inside the block (a recompute under autograd), not read from outside.
        watch_kept: keep weak references to what the block makes, for ``kept``: in strict mode
            (``strict.py``), or where ``parametrize.cached()`` is on (an adapter put on a parameter as a
            parametrization: its cache would keep the first shard's weight); elsewhere ``kept`` finds nothing.
    """

    def __init__(self, known: Iterable[torch.Tensor], grad_only: bool = True, made_since: Optional[int] = None,
                 watch_kept: bool = False):
        super().__init__()
        watched = watch_kept and (_strict.ON or parametrize._cache_enabled > 0)
        self._made_refs: Optional[List[weakref.ref]] = [] if watched else None
        # Made tensors are held only where kept tensors are not asked about at all (their ids then stay unique).
        self._hold_made = not watch_kept
        known = list(known)
        self._known = {id(t) for t in known}
        # Where kept tensors are watched, what a collective took or made in the block (``collectives.py``): the
        # tensors' ids and their memory, by storage, with a description for an error (the memory of the known
        # tensors, and of what they are views of, is never counted).
        self._collective_ids: set = set()
        self._collective_storages: Dict[int, Tuple[StorageWeakRef, str]] = {}
        self._collective_views: Dict[int, Tuple[_TensorRef, str]] = {}
        self._known_tensors = known
        self._grad_only = grad_only
        self._made_since = made_since
        # Outputs are kept alive while the block runs, so their ids cannot be reused by a new tensor.
        self._made: List[torch.Tensor] = []
        self._made_ids: set = set()
        self.foreign: Dict[int, torch.Tensor] = {}

    def _is_foreign(self, t: torch.Tensor) -> bool:
        if id(t) in self._known or id(t) in self._made_ids or id(t) in self.foreign:
            return False
        if self._grad_only and not t.requires_grad:
            return False
        if t._base is not None and id(t._base) in self._known:
            return False  # a view of a known tensor (an expert's slice ``w[e]`` of a 3-D weight)
        node = t.grad_fn
        if node is not None and self._made_since is not None and node._sequence_nr() >= self._made_since:
            return False
        if self._wraps_made_tensors(t):
            self._made_ids.add(id(t))
            return False
        return True

    def _wraps_made_tensors(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a wrapper tensor subclass (``__tensor_flatten__``: a ``DTensor``, a collective's
        pending result) around tensors made in the block. Such a wrapper is built by a constructor no
        torch call hands back (``DTensor.from_local`` inside an autograd Function, a tensor-parallel hook),
        so it is never among the calls' outputs; what it holds is, and that decides where it comes from."""
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is None:
            return False
        inner = _inner_tensors(t)
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
        # What a made wrapper holds was made with it (a DTensor op's local result, made below this mode by
        # the op's dispatch and read later through ``to_local``): never a tensor from outside.
        inner = [i for t in made if type(t) not in _PLAIN_TYPES for i in _inner_tensors(t)]
        if self._made_refs is not None:
            # The inner tensors are watched too: a hook can keep a DTensor's local tensor alone.
            self._made_refs.extend(map(weakref.ref, made))
            self._made_refs.extend(map(weakref.ref, inner))
        # Kept alive so that no id is reused, unless the block watches for kept tensors (then each must
        # be free to die); a tensor that existed before the block never shares an id with one made inside
        # it while both live, so a stale id can only be another one made inside. (Made tensors need a
        # gradient too where the block runs with grad mode on: the generic forward in training.)
        if self._hold_made:
            self._made.extend(made)
        self._made_ids.update(map(id, made))
        self._made_ids.update(map(id, inner))
        if self._made_refs is not None and is_collective(func):
            # Only what was made in the block: a buffer or the call's input that a collective reads or
            # writes in place existed before it, and outlives it by right.
            self._record_collective([t for t in (*inputs, *outputs) if id(t) in self._made_ids])
        return out

    def _record_collective(self, tensors: List[torch.Tensor]) -> None:
        for t in tensors:
            self._collective_ids.add(id(t))
            if t._base is not None and id(t._base) not in self._made_ids:
                # A view made here of memory from before the block (the call's input): the memory outlives the
                # block by right, the view must not.
                self._collective_views.setdefault(id(t), (_TensorRef(t), f"{describe([t])} a collective took"))
                continue
            for storage in _storages(t):
                if storage.cdata not in self._collective_storages:
                    self._collective_storages[storage.cdata] = (storage, f"{describe([t])} a collective took or made")

    def foreign_tensors(self) -> List[torch.Tensor]:
        return list(self.foreign.values())

    def kept(self, expected: Iterable[torch.Tensor] = ()) -> List[torch.Tensor]:
        """Tensors made inside the block that are still alive, besides ``expected`` and their views:
        something (a hook, the forward itself) kept them, e.g. an activation stashed for a loss; or, for one
        a collective took or made (``held_by_collective``), its communication backend, for a moment."""
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
        """Whether ``t``, made in the block and alive, is a tensor a collective took or made. (An id is
        recorded while its tensor lives; one reused by a later tensor can only make the caller wait for that
        tensor too, never let one go unchecked.)"""
        return id(t) in self._collective_ids

    def collective_memory(self, expected: Iterable[torch.Tensor] = ()) -> List[Tuple[Released, str]]:
        """The memory a collective in the block took or made that is still alive, besides that of ``expected``
        and of the known tensors, and the views of older memory it took that are still alive: the backend holds
        them for a moment, or something kept them (the tensor itself, or a view of it, such as
        ``AsyncCollectiveTensor.wait()``'s, which no torch function mode is handed)."""
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
