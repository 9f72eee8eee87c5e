"""The CPU generator states the generic tiled path saves, shown to the step's tracker as host memory.

The generic kernel (``tiled_core/kernels/generic.py``) and the sharded Function
(``tiled_core/sharded_autograd.py``) keep ``torch.get_rng_state()`` for every shard so that the backward
recompute draws the forward's random numbers; ``replay_rng_state`` takes one more while it swaps a saved
state in. Each is a CPU uint8 tensor of its own (5,056 bytes: the Mersenne Twister's state), made on the
meta device too, and ``torch.get_rng_state`` is no dispatched op, so the dispatch-mode tracker never sees
it. Here every real call of ``tiled_mlp.core.sharded_autograd.capture_rng_state`` during the step hands its CPU state to
``on_state`` (the tracker's ``track_host``), which then follows the storage until it is freed: the counted
bytes live exactly as long as the states do, whatever path, shard count or checkpointing made them.

The function is replaced wherever a ``tiled_core`` module holds it by name (``from ..sharded_autograd import
capture_rng_state``), found by identity, so a module that imports it later is not missed.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, List, Tuple

import torch

from tiled_mlp.core import sharded_autograd as rng


@contextlib.contextmanager
def generator_states_shown(on_state: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Within the block, every CPU generator state the tiled path captures is passed to ``on_state``."""
    original = rng.capture_rng_state

    def capture_rng_state(device: torch.device):
        state = original(device)
        on_state(state[0])
        return state

    holders: List[Tuple[object, str]] = [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module is not None and (module_name == "tiled_mlp.core" or module_name.startswith("tiled_mlp.core."))
        for name, value in list(vars(module).items())
        if value is original
    ]
    for module, name in holders:
        setattr(module, name, capture_rng_state)
    try:
        yield
    finally:
        for module, name in holders:
            setattr(module, name, original)
