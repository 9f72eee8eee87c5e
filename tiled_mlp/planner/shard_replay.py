"""Same-size shards of one tiled call modelled once, their allocations logged again for the others.

A tiled call runs its kernel once per token shard (``tiled_core/sharded_autograd.py``, both
shapes): an 8B step at a million tokens is thousands of kernel calls, each tens of
meta-device ops through the tracker, and that loop is most of what a plan costs. On the meta device a
kernel call's allocations and frees depend only on the shapes, dtypes and Python objects it is given,
never on values, so the calls of one loop that see the same shapes log the same events.

Within the step (``shards_replayed``), every kernel call (``forward_into``, ``backward_into``, a loss
kernel's ``shard``) is keyed by the objects and shapes it gets: the loop's own tensors (the bases the
shard views are cut from, alive exactly as long as the loop), the kernel, the gradient accumulator,
every shape and dtype, and each shard's length (its offset aside). A call is run for real and its slice
of the tracker's log recorded; once two consecutive real calls of one key log the same slice, and that
slice is closed (it frees only what it allocated, and what it leaves alive is at most the tensor it
returns), every later call of that key is not run: its slice is appended to the log again, with fresh
serials, and the tensor it returns is a shape-only stand-in that the tracker follows until it is freed,
as it followed the real one. The first calls of a loop (which allocate the gradient accumulators, keep
the first shard's loss, or capture the RNG state once) differ and stay real; so does a shorter last
shard (another key), and every call of a key whose slices never repeat. What the loop does around its
kernel calls (the generator states it saves per shard, the loss's running sum) still runs for real.

Only the meta step takes this path (a CPU step is measured, every shard run); the planner's full-depth
re-check of its answers takes it too (what that checks is the composition of layers), and
``tests/planner/test_planner_shard_replay.py`` holds the shortened log equal, event for event, to the full one,
the re-check's included.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

import torch

# The kernel interface the shard loops call, one call per shard (``tiled_core/kernels/base.py``), and
# the modules that define the kernels.
KERNEL_METHODS = ("forward_shard", "backward_shard", "forward_into", "backward_into", "shard")
KERNEL_MODULES = ("tiled_mlp.core.kernels.gated", "tiled_mlp.core.kernels.generic", "tiled_mlp.core.kernels.lm_head",
                  "tiled_mlp.core.kernels.rms_norm")

# One call's slice of the log, as a pattern: ("A", bytes, kind, what, host kind) for an allocation,
# ("F", bytes, index of the allocation in the slice) for a free.
_Entry = Tuple[Any, ...]


@dataclass(frozen=True)
class _Returned:
    """What a kernel call returned: nothing, one of its arguments, or the storage it allocated."""

    kind: str  # "none", "arg" or "new"
    arg: Any = None  # the argument's position (an int) or keyword (a str), for "arg"
    allocation: int = -1  # the returned storage's allocation among the slice's entries, for "new"
    layout: Tuple[Any, ...] = ()  # (shape, stride, dtype), for "new"


@dataclass(frozen=True)
class _Written:
    """A slice as a replay writes it into the log: each entry's serial as its allocation's rank in the
    slice (1 for the first), added to the tracker's serial at the replay."""

    log: List[Tuple[int, int, str]]  # (rank, bytes, kind; "" for a free), as ``TimelineTracker._log``
    allocations: int
    net: int  # the bytes the slice leaves live
    highest: int  # the most bytes live after any of its allocations, over what was live before it
    what: List[Tuple[int, str]]  # the ranks' labels, where the step is described
    host_kinds: List[Tuple[int, str]]
    returned_rank: int  # the returned storage's rank and bytes, for a "new" return
    returned_bytes: int


@dataclass(frozen=True)
class _Slice:
    entries: Tuple[_Entry, ...]
    returned: _Returned

    @functools.cached_property
    def written(self) -> _Written:
        rank: Dict[int, int] = {}  # entry index -> its allocation's rank
        log: List[Tuple[int, int, str]] = []
        what: List[Tuple[int, str]] = []
        host_kinds: List[Tuple[int, str]] = []
        live = highest = 0
        for i, entry in enumerate(self.entries):
            if entry[0] == "A":
                _, nbytes, kind, label, host_kind = entry
                rank[i] = len(rank) + 1
                log.append((rank[i], nbytes, kind))
                live += nbytes
                highest = max(highest, live)
                if label:
                    what.append((rank[i], label))
                if host_kind is not None:
                    host_kinds.append((rank[i], host_kind))
            else:
                _, nbytes, allocation = entry
                log.append((rank[allocation], nbytes, ""))
                live -= nbytes
        allocation = self.returned.allocation
        returned_bytes = self.entries[allocation][1] if self.returned.kind == "new" else 0
        return _Written(log, len(rank), live, highest, what, host_kinds, rank.get(allocation, 0), returned_bytes)


@dataclass
class _Record:
    bases: List[weakref.ref]  # the loop's tensors: a dead one ends the record
    last: Optional[_Slice] = None
    periodic: bool = False  # two consecutive real calls logged ``last``: the rest are replayed

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.bases)


class ShardReplay:
    """The records of one step's kernel calls, and the tracker whose log they read and extend."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self._records: Dict[Hashable, _Record] = {}
        self.replayed = 0  # kernel calls not run (their slices logged again): for the tests
        self.run = 0  # kernel calls run

    def call(self, original: Callable, kernel: Any, args: tuple, kwargs: dict) -> Any:
        # The bookkeeping reads tensors' attributes (``_base`` is a tensor): unseen by a torch-function
        # mode around the call (the shard loop's ``TensorReads``), which would count it as made there.
        with torch._C.DisableTorchFunction():
            key, bases = _key(original, kernel, args, kwargs)
        record = self._records.get(key) if key is not None else None
        if record is not None and not record.alive():
            del self._records[key]
            record = None
        if record is not None and record.periodic and record.last is not None:
            self.replayed += 1
            with torch._C.DisableTorchFunction():
                return self._replay(record.last, args, kwargs)
        self.run += 1
        start = len(self.tracker._log)
        out = original(kernel, *args, **kwargs)
        if key is None:
            return out
        with torch._C.DisableTorchFunction():
            logged = self._slice(start, out, args, kwargs)
        if record is None:
            record = self._records[key] = _Record([weakref.ref(b) for b in bases])
        record.periodic = logged is not None and logged == record.last
        record.last = logged
        return out

    def _slice(self, start: int, out: Any, args: tuple, kwargs: dict) -> Optional[_Slice]:
        """The log since ``start`` as a pattern, or None where it is not closed (a free of an earlier
        allocation, or something left alive that is not the returned tensor)."""
        t = self.tracker
        log = t._log[start:]
        index_of: Dict[int, int] = {}  # serial -> its allocation's index in the slice
        entries: List[_Entry] = []
        for serial, nbytes, kind in log:
            if kind:
                index_of[serial] = len(entries)
                entries.append(("A", nbytes, kind, t._what.get(serial, ""), t._host_kind_of.get(serial)))
            elif serial in index_of:
                entries.append(("F", nbytes, index_of.pop(serial)))
            else:
                return None
        returned = _returned(out, args, kwargs)
        if returned is None:
            return None
        if returned.kind == "new":
            storage_key = out.untyped_storage()._cdata
            serial = t._serial_of.get(storage_key)
            if serial is None or set(index_of) != {serial}:
                return None
            returned = _Returned("new", allocation=index_of[serial], layout=returned.layout)
        elif index_of:
            return None
        return _Slice(tuple(entries), returned)

    def _replay(self, logged: _Slice, args: tuple, kwargs: dict) -> Any:
        t = self.tracker
        written = logged.written
        base = t._serial
        t._log.extend([(base + rank, nbytes, kind) for rank, nbytes, kind in written.log])
        t._serial = base + written.allocations
        t.peak_bytes = max(t.peak_bytes, t.current_bytes + written.highest)
        t.current_bytes += written.net
        for rank, what in written.what:
            t._what[base + rank] = what
        for rank, host_kind in written.host_kinds:
            t._host_kind_of[base + rank] = host_kind
        returned = logged.returned
        if returned.kind == "new":
            stand_in = _stand_in(returned.layout)
            t.follow(stand_in, base + written.returned_rank, written.returned_bytes)
            return stand_in
        if returned.kind == "arg":
            return args[returned.arg] if isinstance(returned.arg, int) else kwargs[returned.arg]
        return None


def _stand_in(layout: Tuple[Any, ...]) -> torch.Tensor:
    shape, stride, dtype = layout
    # Made outside the tracker (no Python dispatch): ``follow`` logs it as the replayed allocation.
    with torch._C._DisableTorchDispatch():
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _returned(out: Any, args: tuple, kwargs: dict) -> Optional[_Returned]:
    if out is None:
        return _Returned("none")
    for position, value in [*enumerate(args), *kwargs.items()]:
        if value is out:
            return _Returned("arg", arg=position)
    if (type(out) is torch.Tensor and out.device.type == "meta" and not out.requires_grad and out._base is None
            and out.storage_offset() == 0):
        layout = (tuple(out.shape), out.stride(), out.dtype)
        if _stand_in(layout).untyped_storage().nbytes() == out.untyped_storage().nbytes():
            return _Returned("new", layout=layout)
    return None


def _key(original: Callable, kernel: Any, args: tuple, kwargs: dict) -> Tuple[Optional[Hashable], list]:
    """The call's key and the loop's tensors it names (None: not keyed, always run). Tensors count by
    their base (a shard is a view of the loop's flat tensor) and layout, slices by their length, other
    objects by identity (alive while the loop's tensors are: the kernel, the accumulator, the tensors)."""
    bases: list = []
    try:
        described = (original, id(kernel), tuple(_describe(a, bases) for a in args),
                     tuple(sorted((k, _describe(v, bases)) for k, v in kwargs.items())))
    except _NotKeyed:
        return None, []
    if not bases:  # nothing ties the key to one loop
        return None, []
    return described, bases


def _describe(value: Any, bases: list) -> Hashable:
    # A plain function, not a closure over ``bases``: a recursive closure is a reference cycle, and the
    # loop's tensors would then outlive the call until the collector ran, moving their frees in the log.
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise _NotKeyed
        if value.device.type != "meta":
            raise _NotKeyed
        base = value._base if value._base is not None else value
        if value._base is not None:
            bases.append(base)
        return ("T", id(base), tuple(value.shape), value.stride(), value.dtype, value.requires_grad)
    if isinstance(value, slice):
        if not all(isinstance(v, (int, type(None))) for v in (value.start, value.stop, value.step)):
            raise _NotKeyed
        return ("S", (value.stop or 0) - (value.start or 0), value.step)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, id(value), tuple(_describe(v, bases) for v in value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    return ("O", id(value))


class _NotKeyed(Exception):
    pass


_ACTIVE: List[ShardReplay] = []


def _kernel_classes() -> List[type]:
    classes = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (isinstance(value, type) and value.__module__ == name
                    and any(m in vars(value) for m in KERNEL_METHODS)):
                classes.append(value)
    return classes


def _replaying(original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        if not _ACTIVE:
            return original(self, *args, **kwargs)
        return _ACTIVE[-1].call(original, self, args, kwargs)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


@contextlib.contextmanager
def shards_replayed(tracker) -> Iterator[ShardReplay]:
    """Within the block, the tiled kernels' calls are keyed and replayed into ``tracker``'s log (see the
    module doc); the kernels' classes are as they were after it."""
    patched = []
    for cls in _kernel_classes():
        for name in KERNEL_METHODS:
            if name in vars(cls):
                original = vars(cls)[name]
                patched.append((cls, name, original))
                setattr(cls, name, _replaying(original))
    replay = ShardReplay(tracker)
    _ACTIVE.append(replay)
    try:
        yield replay
    finally:
        _ACTIVE.remove(replay)
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)
