"""Tiling a module in place by swapping its class for a generated subclass (``TiledLlamaMLP``, as ``fully_shard``
makes ``FSDPLlamaMLP``), and untiling it by swapping the class back. Every check runs before the class changes.
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from torch import nn

from tiled_mlp.strategies.base import Strategy
from tiled_mlp.strategies.resolver import StrategyArg, resolve_strategy, strategy_from_arg

from .fast_path import fast_path_problem, fast_refused
from .module_forward import TiledForward, forward_signature, is_tiled
from .shard_plan import NumShards
from .tiled_call import count_registrations
from .tiling_state import STATE_ATTR, TilingState, check_config

_CLASSES: Dict[Tuple[type, type], type] = {}


def tiled_class(mixin: type, base: type) -> type:
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        name = f"Tiled{base.__name__}"
        signature = forward_signature(base)
        cls = type(name, (mixin, base), {"_tiled_base": base, "_tiled_mixin": mixin, "__module__": mixin.__module__,
                                         "__qualname__": name, "_tiled_signature": signature,
                                         "forward": TiledForward(signature)})
        _CLASSES[key] = cls
    return cls


def rebuild(mixin: type, base: type) -> nn.Module:
    return object.__new__(tiled_class(mixin, base))


# The names each tiling mixin defines in its own class body, taken when the class is made: another library may add
# attributes to every nn.Module subclass afterwards (DeepSpeed's ``zero.Init`` leaves ``_old_init``).
_OWN_NAMES: Dict[type, FrozenSet[str]] = {}


def record_own_names(mixin: type) -> None:
    _OWN_NAMES[mixin] = frozenset(n for n in vars(mixin) if not (n.startswith("__") and n.endswith("__")))


def own_names(mixin: type) -> List[str]:
    """Names a tiled class adds on top of its base (which must not hide one of the base's)."""
    names: set = set()
    for cls in mixin.__mro__:
        if cls is nn.Module:
            break
        names.update(_OWN_NAMES[cls])
    return sorted(names - {"forward", "extra_repr", "_tiled_base", "_tiled_mixin"})


def prepare_tiling(mixin: type, mlp: Optional[nn.Module], strategy: StrategyArg, num_shards: NumShards, path: str,
                   grad_accum_dtype, ancestors: Sequence[nn.Module] = ()) -> Optional[Strategy]:
    """Every check made before ``mlp`` is changed; returns the fixed strategy (None for "auto")."""
    if not isinstance(mlp, nn.Module):
        raise TypeError(f"TiledMLP tiles an nn.Module, got {type(mlp).__name__}")
    if is_tiled(mlp):
        raise TypeError(f"this {type(mlp).__name__} is already tiled; untile it first to change its tiling")
    check_config(num_shards, path, grad_accum_dtype)
    fixed = strategy_from_arg(strategy)
    taken = [n for n in (STATE_ATTR, *own_names(mixin)) if hasattr(mlp, n) or n in mlp.__dict__]
    if taken:
        raise TypeError(f"cannot tile {type(mlp).__name__} in place: it already has attributes named {taken}, "
                        "which tiling would hide")
    # Reject what is already known to be unsupported (FSDP1, per-Linear FSDP2) now; "auto" is
    # resolved again at every forward, since the model is usually wrapped after it is tiled.
    resolved = fixed or resolve_strategy(mlp, ancestors)
    resolved.check_supported(mlp)
    resolved.check_composed(mlp)
    if path == "fast":
        why_not = fast_path_problem(mixin, mlp, resolved.is_backend_hook)
        if why_not:
            raise fast_refused(mlp, why_not)
    return fixed


def install_tiling(mixin: type, mlp: nn.Module, state: TilingState) -> Any:
    count_registrations()  # the call plans' counter, installed here: outside any trace
    # An instance forward would hide the tiled class's forward: it becomes what each shard runs.
    state.instance_forward = mlp.__dict__.pop("forward", None)
    mlp.__class__ = tiled_class(mixin, type(mlp))
    mlp.__dict__[STATE_ATTR] = state
    return mlp


def untile(module: nn.Module) -> nn.Module:
    """Put the original class back and drop the tiling: the exact module that was tiled."""
    base = type(module).__dict__.get("_tiled_base")
    if base is None:
        if is_tiled(module):
            raise TypeError(
                f"{type(module).__name__} was wrapped again after it was tiled (fully_shard?); "
                "untile before such wrapping")
        raise TypeError(f"{type(module).__name__} is not tiled")
    state = module.__dict__.pop(STATE_ATTR)
    module.__class__ = base
    if state.instance_forward is not None:
        module.__dict__["forward"] = state.instance_forward
    return module
