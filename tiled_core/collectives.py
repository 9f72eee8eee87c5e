"""What a shard's collectives (a tensor-parallel hook's all-reduce) leave behind, and how the tiled call waits
for it: a pending result (``AsyncCollectiveTensor``) stays registered until waited for, so the recompute waits
itself (``wait_pending``); and gloo marks work complete before its thread drops the tensors (about 1 call in 7 on
2 ranks), so the check that nothing made in a shard outlives it waits a bounded time (``wait_released``).
"""
from __future__ import annotations

import functools
import time
from typing import Any, Optional, Sequence

import torch

# torch's operator namespaces of collectives: the functional ones DTensor uses, their autograd variants, c10d's.
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})

# How long a tensor a collective took or made may stay alive after its shard before it counts as kept.
RELEASE_BOUND_S = 2.0
# The module whose public functions (``torch.distributed``'s collectives) hand themselves to torch function modes.
_C10D_PYTHON_MODULE = "torch.distributed.distributed_c10d"


def is_collective(func: Any) -> bool:
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace in COLLECTIVE_NAMESPACES
    if isinstance(func, torch._ops.OpOverloadPacket):  # ``torch.ops._c10d_functional.all_reduce(...)``, as DTensor calls
        return func._qualified_op_name.split("::", 1)[0] in COLLECTIVE_NAMESPACES
    return getattr(func, "__module__", None) == _C10D_PYTHON_MODULE


def completed(out: torch.Tensor) -> torch.Tensor:
    """``out``, waited for where it is a collective's pending result (a tensor-parallel output hook's)."""
    return out.wait() if is_pending(out) else out  # type: ignore[attr-defined]  # an AsyncCollectiveTensor


def is_pending(out: torch.Tensor) -> bool:
    pending = _pending_collective_class()
    return pending is not None and isinstance(out, pending)


def wait_pending(out: torch.Tensor) -> None:
    """Wait for the collective ``out`` is the pending result of, keeping ``out`` (the recompute needs its graph)."""
    if is_pending(out):
        out.trigger_wait()  # type: ignore[attr-defined]  # an AsyncCollectiveTensor


@functools.lru_cache(maxsize=1)
def _pending_collective_class() -> Optional[type]:
    if not torch.distributed.is_available():
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor


def wait_released(refs: Sequence[Any], bound_s: float = RELEASE_BOUND_S) -> bool:
    """Whether every one of ``refs`` (with ``expired()``) is freed within ``bound_s`` seconds. Sleeping, not
    spinning: the backend's thread needs the interpreter's lock to free the Python object."""
    deadline = time.monotonic() + bound_s
    pause = 1e-5
    while not all(ref.expired() for ref in refs):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True
