"""Per-shard RNG state, so that the backward recompute draws the same random numbers as the forward.

Goes through ``torch.get_device_module(device_type)`` rather than ``torch.cuda`` so CPU, CUDA and
Ascend NPU (``torch.npu``, registered by torch_npu) share one code path.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


def _device_module(device: torch.device):
    if device.type in ("cpu", "meta"):  # meta tensors (shape-only modelling) draw no numbers
        return None
    return torch.get_device_module(device.type)


def capture_rng_state(device: torch.device):
    """The generator state that the next random op on ``device`` (and on the CPU) will use."""
    module = _device_module(device)
    device_state = module.get_rng_state(device) if module is not None else None
    return torch.get_rng_state(), device_state


@contextlib.contextmanager
def replay_rng_state(device: torch.device, state: Optional[tuple]):
    """Run the body with ``state`` installed and put the caller's RNG back afterwards, even on error."""
    if state is None:
        yield
        return
    module = _device_module(device)
    saved = capture_rng_state(device)
    cpu_state, device_state = state
    torch.set_rng_state(cpu_state)
    if module is not None:
        module.set_rng_state(device_state, device)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if module is not None:
            module.set_rng_state(saved[1], device)
