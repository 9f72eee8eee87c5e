"""Call a module once through ``__call__`` with its forward body replaced for that one call.

Backends install their machinery as module hooks: FSDP2 unshards in a forward pre-hook, reshards in a
post-hook and registers its pre-/post-backward hooks on the call's outputs and inputs; ZeRO-3 gathers
and releases the same way. Running the tiled shard loop *inside* one such call makes all of them fire
exactly once per step, however many shards there are, while each shard calls the module's original
forward directly (no hooks per shard).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def call_with_forward(module: nn.Module, body: Callable[[Callable, torch.Tensor], torch.Tensor], x: torch.Tensor):
    """``module(x)`` where the forward is ``body(original_forward, x)``."""
    original = module.forward  # a bound method, or an instance attribute another library installed
    had_instance_forward = "forward" in module.__dict__
    module.forward = lambda inp: body(original, inp)
    try:
        return module(x)
    finally:
        if had_instance_forward:
            module.forward = original
        else:
            del module.forward
