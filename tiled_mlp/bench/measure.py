"""One forward+backward step of an implementation: its peak memory, its time, its gradient error.

Memory: the live-storage tracker (input, grad_output, weights, grads and everything the step makes;
exact); on CUDA the allocator's peak over what the process held before the step, plus the same input,
grad_output and weights, so that both count the same things. Time: the median of
``repeats`` steps after ``warmup`` steps, interleaved across implementations and reported as a ratio
against the untiled module in the same run, so machine speed cancels out; on CPU with freed memory
kept in the process (``cpu_allocator``).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Hashable, List, Mapping, Optional, TypeVar

import torch
from torch import nn

from .cpu_allocator import keep_freed_memory_in_process
from .memory_tracker import LiveMemoryTracker

Key = TypeVar("Key", bound=Hashable)  # an implementation's name, or a policy sweep's target


def one_step(step_fn: Callable, mlp: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    y = step_fn(x)
    y.backward(grad_out)
    return y.detach()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages under ``tensors`` (a view or a shared weight counted once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def peak_bytes(step_fn: Callable, mlp: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> int:
    """Peak live bytes of one step, counting the input, grad_output, weights and gradients."""
    mlp.zero_grad(set_to_none=True)
    x.grad = None
    if x.device.type == "cuda":
        # The allocator counts everything the process holds: the bench's reference outputs, the other
        # implementations' leftovers. The step's own peak is what it adds to that, and the tracker's
        # accounting (input, grad_output, weights) is added back, so both devices count the same things.
        _synchronize(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        held = torch.cuda.memory_allocated(x.device)
        one_step(step_fn, mlp, x, grad_out)
        _synchronize(x.device)
        return torch.cuda.max_memory_allocated(x.device) - held + storage_bytes(x, grad_out, *mlp.parameters())
    tracker = LiveMemoryTracker()
    tracker.track(x, grad_out, *mlp.parameters())
    with tracker:
        one_step(step_fn, mlp, x, grad_out)
    return tracker.peak_bytes


def step_seconds(step_fns: Mapping[Key, Callable], mlp: nn.Module, x, grad_out, repeats: int = 3,
                 warmup: int = 3, on_round: Optional[Callable[[int], None]] = None) -> Dict[Key, float]:
    """Median seconds of one step for each implementation, timed round-robin: step r of every
    implementation runs before step r+1 of any, so a slow spell of the machine (shared CPUs drift by
    20% over minutes) lands on all of them alike instead of on whichever ran then."""
    if x.device.type == "cpu":
        keep_freed_memory_in_process()
    for step_fn in step_fns.values():
        for _ in range(warmup):
            one_step(step_fn, mlp, x, grad_out)
    times: Dict[Key, List[float]] = {name: [] for name in step_fns}
    for round_index in range(repeats):
        for name, step_fn in step_fns.items():
            _synchronize(x.device)
            start = time.perf_counter()
            one_step(step_fn, mlp, x, grad_out)
            _synchronize(x.device)
            times[name].append(time.perf_counter() - start)
        if on_round is not None:
            on_round(round_index)
    return {name: statistics.median(t) for name, t in times.items()}


def step_outputs(step_fn: Callable, mlp: nn.Module, x, grad_out) -> List[torch.Tensor]:
    """Output, input grad and every weight grad of one step (to compare implementations)."""
    y = one_step(step_fn, mlp, x, grad_out)
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    assert all(g is not None for g in grads), "every input and weight of a benchmarked MLP gets a gradient"
    return [y] + [g.clone() for g in grads if g is not None]


def max_relative_error(got: List[torch.Tensor], want: List[torch.Tensor]) -> float:
    """max over tensors of ||got - want|| / ||want|| (in float64)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a, b = a.double(), b.double()
        worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return worst


def shards_used(step_fn, requested) -> int:
    """The shard count the last step ran with (1 for a pass-through), else what was asked for."""
    # Ours records what its last call ran in ``tiling``; the others ran what was asked.
    return getattr(getattr(step_fn, "tiling", None), "last_num_shards", None) or requested


def make_inputs(seq: int, hidden: int, dtype, device, batch: int = 1, seed: int = 0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=generator).to(device=device, dtype=dtype).requires_grad_(True)
    grad_out = torch.randn(batch, seq, hidden, generator=generator).to(device=device, dtype=dtype)
    return x, grad_out
