"""The live-storage tracker, with a timeline split into what each byte is.

``LiveMemoryTracker`` gives one peak. A rank of a sharded backend holds a fraction of the weights and
gradients but all of its activations, so the planner needs the step's memory by kind at every moment:
weights (tracked before the step), gradients (the storages that end up in ``.grad``, known only when
the step is over), the logits and everything computed from them (tensors whose last dim is the
vocabulary) and other activations. Every allocation and free is logged with a serial number (a freed
storage's address may be reused by the next), and ``Timeline`` replays the log.

Host memory is counted apart, by what holds it: the layer inputs that checkpoint offload moves out of
the device (``tiled_mlp.core.checkpoint_offload``) are storages the offload names as it makes them
(``track_host``). On the meta device and on a CPU step alike they are the same kind of storage as the
device's, so the offload's own word is the only way to tell them apart. The CPU generator states the
generic tiled path saves per shard are named the same way (``rng_states.py``): no dispatched op makes them.
"""
from __future__ import annotations

import functools
import weakref
from fractions import Fraction
from itertools import pairwise
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

from ..bench.memory_tracker import LiveMemoryTracker
from .meta_outputs import MetaOutputs
from .meta_values import is_meta_read, zero_read

# Shared by every step of the process: the planner's steps repeat each other's shapes (the settings at
# one length, the layers of one step).
_META_OUTPUTS = MetaOutputs()

WEIGHTS, GRADS, LOGITS, ACTIVATIONS = "weights", "gradients", "logits and loss", "activations"
HOST = "host"  # in host memory: not one of the device's kinds above (the offloaded checkpoints)
GENERATOR_STATES = "generator states"  # in host memory too: the generic tiled path's saved CPU RNG states
HOST_KINDS = (HOST, GENERATOR_STATES)
# One entry of a step's log: the kind of the storage, its bytes, whether it was allocated (else freed), and
# what made it (op, dtype, shape; '' unless the step was described).
Event = Tuple[str, int, bool, str]
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def stored_in(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors whose storages hold ``tensor``'s memory: itself, or a wrapper subclass's inner tensors
    (a DTensor gradient's local shard)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    # A DTensor names its mesh among its inner attributes too: only tensors hold memory.
    inners = [getattr(tensor, name) for name in names]
    return [stored for inner in inners if isinstance(inner, torch.Tensor) for stored in stored_in(inner)]


# A log as runs of events, each repeated its count of times: a composed step's (``compose.py``) repeats one
# layer's events for every inner layer.
Runs = List[Tuple[List[Event], int]]


class Timeline:
    """After each allocation: (weight, gradient, logits, other activation) bytes live on the device, and
    the bytes live in host memory. Kept as the log's runs: the peaks are found without writing out every
    repeat (a composed 8B step is a million events), ``points`` and ``host`` only where asked."""

    def __init__(self, runs: Runs, describe: bool = False):
        self._runs = runs
        self._describe = describe
        # Per run, from its first repeat (``_walk``): its points and host totals, what it adds to each, and
        # its host-kind changes.
        self._walked = [_walk(events) for events, _ in runs]
        self.host_at_peak: Dict[str, int] = {}  # the host bytes at ``host``'s peak by kind (``HOST_KINDS``)
        self._host_peak = 0
        self._host_peak_at()

    @property
    def events(self) -> List[Event]:
        """With ``describe``: the log replayed (``Event``s, each allocation labelled by what made it: op,
        dtype, shape), for ``at_peak``; else empty."""
        return list(self._replayed_events()) if self._describe else []

    def _replayed_events(self) -> Iterable[Event]:
        return (e for events, count in self._runs for _ in range(count) for e in events)

    @functools.cached_property
    def _replayed(self) -> Tuple[List[Tuple[int, int, int, int]], List[int]]:
        points: List[Tuple[int, int, int, int]] = []
        host: List[int] = []
        before: Tuple[int, ...] = (0, 0, 0, 0)
        host_before = 0
        for (_, count), (run_points, run_host, delta, host_delta, _) in zip(self._runs, self._walked, strict=True):
            for k in range(count):
                w, g, lg, a = (b + k * d for b, d in zip(before, delta, strict=True))
                points += [(w + p[0], g + p[1], lg + p[2], a + p[3]) for p in run_points]
                host += [host_before + k * host_delta + h for h in run_host]
            before = tuple(b + count * d for b, d in zip(before, delta, strict=True))
            host_before += count * host_delta
        return points, (host if self._seen_host() else [])

    @property
    def points(self) -> List[Tuple[int, int, int, int]]:
        return self._replayed[0]

    @property
    def host(self) -> List[int]:
        """One per point; empty: nothing was ever on the host."""
        return self._replayed[1]

    def _seen_host(self) -> bool:
        return any(walked[4] for walked in self._walked)

    @property
    def what(self) -> Dict[int, str]:
        """What made each allocation, by its place among the allocations (a described step's only)."""
        allocations = (event for event in self.events if event[2])
        return {i: event[3] for i, event in enumerate(allocations) if event[3]}

    def host_peak(self) -> int:
        """The most host memory held at once during the step (the offloaded layer inputs and the
        generator states)."""
        return self._host_peak

    def _host_peak_at(self) -> None:
        # A repeat's host totals are its first's plus what the repeats before it added: the highest is in
        # the last repeat where they add, else in the first.
        if not self._seen_host():
            return
        live_before: Dict[str, int] = {kind: 0 for kind in HOST_KINDS}
        total_before = 0
        for (_, count), (_, run_host, _, host_delta, host_live) in zip(self._runs, self._walked, strict=True):
            k = count - 1 if host_delta > 0 else 0
            for i, total in enumerate(run_host):
                total += total_before + k * host_delta
                if total > self._host_peak:
                    self._host_peak = total
                    self.host_at_peak = {kind: v for kind, v in _live_at(host_live, i, live_before, k).items() if v}
            live_before = _live_at(host_live, len(run_host), live_before, count - 1)
            total_before += count * host_delta

    def peak(self, weight_scale: float = 1.0, grad_scale: float = 1.0) -> Tuple[float, Tuple[float, float, float, float]]:
        """The peak of ``weights * weight_scale + gradients * grad_scale + logits + activations`` (a rank of
        a backend that divides weights and gradients) and its parts at that moment."""
        return self._peak(weight_scale, grad_scale)[:2]

    def _peak(self, weight_scale: float, grad_scale: float) -> Tuple[float, Tuple[float, float, float, float], int]:
        """``peak``, and after which allocation it is."""
        best, parts, moment = -1.0, (0.0, 0.0, 0.0, 0.0), -1
        before: Tuple[int, ...] = (0, 0, 0, 0)
        scales = (weight_scale, grad_scale, 1.0, 1.0)
        allocations = 0
        for (_, count), (run_points, _, delta, _, _) in zip(self._runs, self._walked, strict=True):
            # Each repeat's totals are the first's plus what the repeats before it added, ``step`` each: the
            # first highest is in the last repeat where that adds, else in the first (where every scaled part
            # is the same in each repeat, so is the total, to the bit). A step of under a byte whose parts
            # cancel is not trusted to the floats' rounding: every repeat is then scanned.
            step = sum((Fraction(d) * Fraction(scale) for d, scale in zip(delta, scales, strict=True)), Fraction(0))
            same = all(d == 0 or scale == 0 for d, scale in zip(delta, scales, strict=True))
            repeats = [count - 1 if step > 0 else 0] if abs(step) >= 1 or same else range(count)
            for k in repeats:
                w0, g0, l0, a0 = (b + k * d for b, d in zip(before, delta, strict=True))
                for i, (pw, pg, pl, pa) in enumerate(run_points):
                    w, g, lg, a = w0 + pw, g0 + pg, l0 + pl, a0 + pa
                    total = w * weight_scale + g * grad_scale + lg + a
                    if total > best:
                        best, parts = total, (w * weight_scale, g * grad_scale, float(lg), float(a))
                        moment = allocations + k * len(run_points) + i
            before = tuple(b + count * d for b, d in zip(before, delta, strict=True))
            allocations += count * len(run_points)
        return best, parts, moment

    def at_peak(self, weight_scale: float = 1.0, grad_scale: float = 1.0) -> Dict[str, float]:
        """What is live on the device at ``peak``'s moment, bytes by what made it, largest first: weights
        and gradients as their kinds (scaled), every other allocation by op, dtype and shape. Needs a
        timeline made with ``describe``."""
        if not self._describe:
            raise ValueError("at_peak needs a timeline made with describe=True")
        moment = self._peak(weight_scale, grad_scale)[2]
        scale = {WEIGHTS: weight_scale, GRADS: grad_scale, **{kind: 0.0 for kind in HOST_KINDS}}
        live: Dict[Tuple[str, str], int] = {}  # (kind, label) -> bytes live
        allocations = 0
        for kind, nbytes, allocated, what in self._replayed_events():
            key = (kind, kind if kind in scale else what or kind)
            live[key] = live.get(key, 0) + (nbytes if allocated else -nbytes)
            if allocated:
                if allocations == moment:  # the point is taken right after this allocation
                    break
                allocations += 1
        out: Dict[str, float] = {}
        for (kind, label), nbytes in live.items():
            out[label] = out.get(label, 0.0) + nbytes * scale.get(kind, 1.0)
        return dict(sorted(((k, v) for k, v in out.items() if v), key=lambda kv: -kv[1]))


class TimelineTracker(LiveMemoryTracker):
    def __init__(self, vocab_size: int, describe: bool = False):
        super().__init__()
        self._describe = describe
        self._what: Dict[int, str] = {}
        self._vocab = vocab_size
        self._serial = 0
        self._serial_of: Dict[int, int] = {}  # live storage key -> serial of its allocation
        self._log: List[Tuple[int, int, str]] = []  # (serial, bytes, kind at allocation; "" for a free)
        self._kind = ACTIVATIONS  # what a new storage is, unless its last dim is the vocabulary
        self._host_kind_of: Dict[int, str] = {}  # serial -> its host kind, for storages in host memory
        self._marks: List[int] = []  # log lengths where a section of the step ends (``mark``)
        self._fake_mode = None
        # Ops answered as a device would, not by their meta kernel (``tensor_parallel.device_answers``): set for a
        # tensor-parallel step on meta, where one more dispatch mode would cost every op of the step.
        self.device_answers: Dict[Any, Callable[[torch.Tensor], Any]] = {}

    def __enter__(self):
        # The fake mode a step runs in, if it runs in one (a model built under ``FakeTensorMode``): its fake
        # tensors are the step's own.
        self._fake_mode = torch._C._get_dispatch_mode(_FAKE)
        return super().__enter__()

    def track_weights(self, tensors: Iterable[torch.Tensor]) -> None:
        self._kind = WEIGHTS
        try:
            self.track(*tensors)
        finally:
            self._kind = ACTIVATIONS

    def track_host(self, tensor: torch.Tensor, kind: str = HOST) -> None:
        """``tensor``'s storage is in host memory, held as ``kind`` (``CheckpointOffload.on_host_copy``;
        ``GENERATOR_STATES`` for ``rng_states.py``)."""
        self._add(tensor)  # an offload copy is made under the tracker, so already logged; a state is not
        self._host_kind_of[self._serial_of[tensor.untyped_storage()._cdata]] = kind

    def track_generator_state(self, tensor: torch.Tensor) -> None:
        self.track_host(tensor, GENERATOR_STATES)

    def follow(self, tensor: torch.Tensor, serial: int, nbytes: int) -> None:
        """``tensor``'s storage is the allocation already logged as ``serial`` (a replayed shard's
        returned tensor, ``shard_replay.py``): its free is logged as that allocation's."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        self._serial_of[key] = serial
        self._live[key] = nbytes
        weakref.finalize(storage, self._free, key)

    def _add(self, tensor: torch.Tensor) -> None:
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
            return self._add_other(tensor)
        # The base tracker's ``_add`` written out for a plain tensor (a step makes a million calls): one
        # storage lookup, the same log entry, the same live entry and finalizer.
        storage = tensor.untyped_storage()
        key = storage._cdata
        live = self._live
        if key in live:
            return None
        kind = self._kind
        if kind == ACTIVATIONS and tensor.dim() >= 1 and tensor.shape[-1] == self._vocab:
            kind = LOGITS
        self._serial += 1
        self._serial_of[key] = self._serial
        nbytes = storage.nbytes()
        self._log.append((self._serial, nbytes, kind))
        live[key] = nbytes
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
        weakref.finalize(storage, self._free, key)
        return None

    def _add_other(self, tensor: torch.Tensor) -> None:
        """``_add`` for a tensor subclass: a wrapper (a DTensor, an ``AsyncCollectiveTensor``) holds no memory of
        its own but its inner tensors' (a DTensor's local shard), which are what is counted."""
        if is_traceable_wrapper_subclass(tensor):
            for inner in stored_in(tensor):
                self._add(inner)
            return
        key = tensor.untyped_storage()._cdata
        if key in self._live:
            return
        kind = self._kind
        if kind == ACTIVATIONS and tensor.dim() >= 1 and tensor.shape[-1] == self._vocab:
            kind = LOGITS
        self._serial += 1
        self._serial_of[key] = self._serial
        nbytes = tensor.untyped_storage().nbytes()
        self._log.append((self._serial, nbytes, kind))
        super()._add(tensor)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's ``__torch_dispatch__`` in a Dynamo-disabling frame unless told otherwise
        # (``TorchDispatchMode._should_skip_dynamo``): a cost on every op, for compiling under the mode,
        # which the planner's steps never do.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The base tracker's, with the op's outputs remembered on the meta device (``meta_outputs.py``)
        # and a value read there answered (``meta_values.py``).
        if is_meta_read(func, args):
            return zero_read(args[0])
        if torch._C._get_dispatch_mode(_FAKE) is not self._fake_mode:
            # A fake mode the step does not run in: DTensor's sharding propagation working out an output's
            # global shape on fake tensors, which allocates nothing on the rank.
            return func(*args, **(kwargs or {}))
        for kind in types:
            if kind is not torch.Tensor and kind is not torch.nn.Parameter and is_traceable_wrapper_subclass_type(kind):
                # The subclass's own dispatch runs next, with this tracker active: the ops on its inner tensors
                # (a DTensor's local matmuls, its collectives' outputs) are what allocate, and are tracked as
                # they run.
                return NotImplemented
        answer = self.device_answers.get(func) if self.device_answers else None
        if answer is not None and args[0].is_meta:
            out = answer(args[0])
        else:
            out = _META_OUTPUTS.call(func, args, kwargs or {})
        # Most ops return one plain tensor: tracked without walking a tree.
        for leaf in (out,) if type(out) is torch.Tensor else tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                serial = self._serial
                self._add(leaf)
                if self._describe and self._serial != serial:
                    self._what[self._serial] = f"{func} {str(leaf.dtype).replace('torch.', '')} {list(leaf.shape)}"
        return out

    def _free(self, key) -> None:
        serial = self._serial_of.pop(key, None)
        if serial is not None:
            self._log.append((serial, self._live.get(key, 0), ""))
        super()._free(key)

    def mark(self) -> None:
        """Close a section of the log here (``sections``): the weights, the forward, the backward."""
        self._marks.append(len(self._log))

    def kinded(self, grads: Iterable[torch.Tensor]) -> List[Event]:
        """The log as ``Event``s, each free carrying its allocation's kind and label; ``grads``
        (the parameters' ``.grad`` after the step) say which storages were gradients all along."""
        stored = (inner for g in grads for inner in stored_in(g))
        grad_serials = {self._serial_of[key] for key in (t.untyped_storage()._cdata for t in stored) if key in self._serial_of}
        made: Dict[int, Event] = {}  # live serial -> its allocation's event
        events: List[Event] = []
        host_kind_of, what = self._host_kind_of.get, self._what.get
        for serial, nbytes, kind in self._log:
            if kind:
                kind = GRADS if serial in grad_serials else host_kind_of(serial, kind)
                event = made[serial] = (kind, nbytes, True, what(serial, ""))
                events.append(event)
            else:
                event = made.pop(serial)
                events.append((event[0], nbytes, False, event[3]))
        return events

    def sections(self, events: List[Event]) -> List[List[Event]]:
        """``events`` (``kinded``) cut at the marks."""
        cuts = [0, *self._marks, len(events)]
        return [events[start:end] for start, end in pairwise(cuts)]

    def timeline(self, events: List[Event]) -> Timeline:
        """``events`` (``kinded``) replayed; with them, for ``at_peak``, where ``describe`` was asked."""
        return replay(events, self._describe)


def replay(events: List[Event], describe: bool = False) -> Timeline:
    """The timeline of a log of events: a point after each allocation; ``describe``: with the events."""
    return Timeline([(events, 1)], describe)


def _walk(events: List[Event]) -> Tuple[List[Tuple[int, int, int, int]], List[int], Tuple[int, int, int, int], int,
                                        List[Tuple[int, str, int]]]:
    """One run of events replayed from nothing: its points and host totals, what it adds to each, and
    each host-kind change (after how many points, the kind, the change)."""
    # The device's kinds are kept in locals, the host's total carried along.
    weights = grads = logits = activations = host_total = 0
    points: List[Tuple[int, int, int, int]] = []
    host: List[int] = []
    host_changes: List[Tuple[int, str, int]] = []
    for kind, nbytes, allocated, _ in events:
        change = nbytes if allocated else -nbytes
        if kind == ACTIVATIONS:
            activations += change
        elif kind == LOGITS:
            logits += change
        elif kind == GRADS:
            grads += change
        elif kind == WEIGHTS:
            weights += change
        else:
            if kind not in HOST_KINDS:
                raise KeyError(kind)
            host_total += change
            host_changes.append((len(points), kind, change))
        if allocated:
            points.append((weights, grads, logits, activations))
            host.append(host_total)
    return points, host, (weights, grads, logits, activations), host_total, host_changes


def _live_at(host_changes: List[Tuple[int, str, int]], point: int, before: Dict[str, int], k: int) -> Dict[str, int]:
    """The host bytes live by kind at a run's ``point``-th point (its number of points: its end) in its
    ``k``-th repeat, ``before`` live before the run."""
    live = dict(before)
    for at, kind, change in host_changes:
        live[kind] += k * change + (change if at <= point else 0)
    return live
