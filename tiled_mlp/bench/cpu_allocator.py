"""Steady CPU timings: keep freed memory in the process instead of handing it back to the OS.

glibc serves every buffer above 32 MiB with a fresh ``mmap`` and unmaps it when it is freed, so each
step of an untiled MLP pays page faults on its large intermediates, which shard-sized buffers do not:
untiled steps then vary by 40% from one step to the next. Turning off ``mmap`` allocation and heap
trimming makes the heap keep and reuse freed memory, as a GPU's caching allocator does, so a time
ratio measures compute rather than the kernel's page-fault path. Applied to every implementation
alike; a no-op where glibc's ``mallopt`` is not available.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_memory_in_process() -> bool:
    """Once per process; True when the setting took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # no such library, or a libc without mallopt (musl, macOS)
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
