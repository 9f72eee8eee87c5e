"""What a tiled call decides before it touches a tensor, kept while nothing it rests on changes.

Every forward used to re-walk the module for the trainable parameters, its sizes, its hooks and the
fast-path decision (a probe of the real forward). One walk of the module now builds one key
(``fast_path.module_key``: its parameters, buffers, submodules, hooks, training modes, settings, and
the input's dtype and device) and, with the strategy, picks the cached plan or makes a new one. The
strategy itself is resolved at every call (a model is usually wrapped by its backend after it was
tiled, and a warm-up forward must not pin the single-device fallback); without a process group that
costs a few attribute reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .fast_path import module_key
from .gated_spec import GatedMLPSpec


@dataclass
class CallPlan:
    key: tuple
    keep_alive: tuple  # the objects the key names by id, so that no id is reused while it is cached
    trainable: List[torch.Tensor]
    intermediate: Optional[int]
    param_bytes: int
    # The fast-path decision, made at the first call that needs it (inside the strategy's gathered
    # context, where the probe can read the weights) and kept with the plan.
    fast: Optional[Tuple[Optional[GatedMLPSpec], str]] = None
    fast_kernel: Optional[Any] = field(default=None, repr=False)
    # The generic kernel's view of the module's structure (``kernels.generic.GenericLayout``).
    generic_layout: Optional[Any] = field(default=None, repr=False)


def current_key(module: nn.Module, strategy: Any, x: torch.Tensor) -> Tuple[tuple, tuple]:
    key, keep_alive = module_key(module, x)
    tiling: Any = module.tiling  # the path asked for and the kernels allowed decide the fast path too
    config = (tiling.path, tiling.use_liger, tiling.instance_forward is not None)
    # The strategy answers trainable_params and param_bytes: another backend, another plan. (Its type:
    # "auto" makes a new instance at every call.)
    return (key, config, type(strategy)), keep_alive
