"""What a shard's collectives (a tensor-parallel hook's all-reduce) leave behind, and how the tiled call waits
for it. Two things outlive such a call for a while, neither a tensor the shard kept:

- **the pending result** (``AsyncCollectiveTensor``): c10d's work registry holds it until someone waits. The
  forward waits when it copies the shard's output; the recompute needs only the graph, so it waits itself
  (``wait_pending``), or every recomputed shard leaves one registered work behind.
- **the backend's own reference**: gloo marks the work complete before its worker thread drops the tensors
  (measured: about 1 call in 7 on 2 ranks), so the check that no tensor made in a shard outlives it waits a
  bounded time for what a collective took or made (``wait_released``); anything else still alive is refused.

A collective is recognised by what it is: an operator of c10d's namespaces (how DTensor redistributes) or a
function of ``torch.distributed.distributed_c10d`` (those hand themselves to torch function modes; DeepSpeed's
AutoTP calls them). What it took or made is watched by its memory: a pending result hands out its value through
views made below any function mode, and a view kept by a hook keeps the memory alive.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Optional, Sequence

import torch

# torch's operator namespaces of collectives: the functional ones DTensor redistributes with, their autograd
# variants, and the in-place ops ``torch.distributed``'s calls dispatch to (a function mode sees those only where
# Python calls them through ``torch.ops.c10d``; ``torch.distributed``'s own functions are recognised as such).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})

# How long a tensor a collective took or made may stay alive after its shard, held by the communication
# backend, before the tiled call takes it for kept. Gloo lets go within microseconds of the wait.
RELEASE_BOUND_S = 2.0


# The module whose public functions (the collectives and point-to-point calls of ``torch.distributed``) hand
# themselves to torch function modes.
_C10D_PYTHON_MODULE = "torch.distributed.distributed_c10d"


def is_collective(func: Any) -> bool:
    """Whether ``func`` (what a torch function mode is handed) is an operator of c10d's namespaces or one of
    ``torch.distributed``'s own collective functions."""
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace in COLLECTIVE_NAMESPACES
    if isinstance(func, torch._ops.OpOverloadPacket):  # ``torch.ops._c10d_functional.all_reduce(...)``, as DTensor calls
        return func._qualified_op_name.split("::", 1)[0] in COLLECTIVE_NAMESPACES
    return getattr(func, "__module__", None) == _C10D_PYTHON_MODULE


def completed(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor whose value is there: a collective's pending result (``AsyncCollectiveTensor``, what
    a tensor-parallel output hook returns) is waited for, and its value returned; anything else as it is."""
    return out.wait() if is_pending(out) else out  # type: ignore[attr-defined]  # an AsyncCollectiveTensor


def is_pending(out: torch.Tensor) -> bool:
    """Whether ``out`` is a collective's pending result (an ``AsyncCollectiveTensor``)."""
    pending = _pending_collective_class()
    return pending is not None and isinstance(out, pending)


def wait_pending(out: torch.Tensor) -> None:
    """Wait for the collective ``out`` is the pending result of (if it is one), keeping ``out`` itself: the
    backward recompute differentiates through it and needs its graph, not its value."""
    if is_pending(out):
        out.trigger_wait()  # type: ignore[attr-defined]  # an AsyncCollectiveTensor


@functools.lru_cache(maxsize=1)
def _pending_collective_class() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor


def wait_released(refs: Sequence[Any], bound_s: float = RELEASE_BOUND_S) -> bool:
    """Whether what every one of ``refs`` refers to (a ``StorageWeakRef``, or anything else with ``expired()``)
    is freed within ``bound_s`` seconds, polled with growing sleeps from a few microseconds. Sleeping, not
    spinning: the backend's thread drops its last reference to a tensor that Python knows by freeing the Python
    object too, which takes the interpreter's lock."""
    deadline = time.monotonic() + bound_s
    pause = 1e-5
    while not all(ref.expired() for ref in refs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True
