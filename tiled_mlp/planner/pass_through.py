"""Where a tiled-MLP setting's step is its untiled twin's: every tiled MLP passes its call through.

Under ``num_shards="auto"`` a tiled MLP runs untiled where tiling would not pay (``auto_shards.py``),
and the call then runs the module's own forward on the hidden states it was given, nothing else
(``tiled_call``'s untiled pass-through). When every tiled module of a step does that, the step is the same model's step
without tiled MLPs, allocation for allocation, so the planner models the twin (the setting with
``tiled=False``, all else equal) once for both. Short lengths are where this happens: an 8B model
passes its MLPs through up to about 2048 tokens, the length the search models first and, when
nothing fits, the one each answer is checked at.

The decision is asked of the auto policy's own rule, as the call asks it, never of a modelled step:
``decide_map_call`` first applies the fast kernel's rule (``shard_count`` with ``generic=False``)
and returns "untiled" when it says so, whatever kernel would otherwise run (every other kernel needs
more tokens, and the shallow-key shortcut before it can only answer untiled earlier). That rule
depends on the call's token count, hidden width and element size, and on the module's intermediate
size and parameter bytes, all known before the step. Shared only where every tiled module is a
decoder layer's ``mlp`` (its input is the layer's hidden states, ``[batch, tokens, hidden]``), its
count is "auto" and its strategy allows an untiled call; anything else (tiled norms, experts tiled
inside an MoE block, a fixed count, tensor parallelism) is modelled as it is. ``tests/planner/test_planner_pass_through.py``
holds the shared step equal to the tiled setting's own at every length around the policy's boundary.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from tiled_mlp.core.auto_shards import MLPSize, auto_decision, device_class, intermediate_size
from tiled_mlp.core.module_forward import is_tiled
from tiled_mlp.core.tiling_state import tiling_of
from tiled_mlp.strategies.resolver import resolve_strategy

from .layers import decoder_layers
from .step import Setting


def untiled_twin(setting: Setting) -> Optional[Setting]:
    """The setting whose step ``setting``'s is where its MLPs pass through (None: no such twin, its
    tiling is not the auto policy's on the MLPs alone)."""
    # Under tensor parallelism the call's decision is taken on the rank's share of the MLP (the fast kernel's
    # local view), which ``mlps_pass_through`` does not ask: such a step is modelled as it is.
    if not setting.tiled or setting.tiled_norms or setting.num_shards != "auto" or setting.tp > 1:
        return None
    return replace(setting, tiled=False)


def twin_groups(settings: Sequence[Setting]) -> List[List[Setting]]:
    """``settings``, each beside its untiled twin where both are among them (the two may share steps),
    in the order given: the parts of a plan that can be modelled apart (``workers.py``)."""
    groups: Dict[Setting, List[Setting]] = {}
    for setting in settings:
        twin = untiled_twin(setting)
        groups.setdefault(twin if twin is not None and twin in settings else setting, []).append(setting)
    return list(groups.values())


def mlps_pass_through(model: nn.Module, layers: int, tokens: int, hidden: int, dtype: torch.dtype) -> bool:
    """Whether every tiled module of ``model`` (built under a setting with a twin, ``layers`` decoder
    layers) runs its call untiled on ``tokens`` tokens of ``hidden``-wide hidden states in ``dtype``, by
    the auto policy's rule."""
    mlps = {id(getattr(layer, "mlp", None)) for layer in decoder_layers(model, layers)}
    tiled = [m for m in model.modules() if is_tiled(m)]
    if not tiled or any(id(m) not in mlps for m in tiled):
        return False
    element = torch.empty((), dtype=dtype).element_size()
    for module in tiled:
        state = tiling_of(module)
        if isinstance(state.num_shards, int):
            return False
        strategy = state.fixed_strategy or resolve_strategy(module, state.ancestors())
        if not strategy.allows_untiled_call(module):
            return False
        size = MLPSize(hidden, intermediate_size(module), strategy.param_bytes(module), element, None)
        if auto_decision(tokens, size, device_class(torch.device("meta"))).num_shards is not None:
            return False
    return True
