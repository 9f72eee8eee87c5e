"""Name -> Strategy class. Third parties add theirs with ``register_strategy(MyStrategy)``."""
from __future__ import annotations

import inspect
from typing import Dict, List, Type

from .base import REQUIRED_METHODS, Strategy

_REGISTRY: Dict[str, Type[Strategy]] = {}


def register_strategy(cls: Type[Strategy], override: bool = False) -> Type[Strategy]:
    """Register a ``Strategy`` subclass under ``cls.name``; usable as a class decorator."""
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a subclass of tiled_mlp.Strategy, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name` to be registered")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: missing {', '.join(missing)}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"{cls.__name__}.priority must be an int, got {cls.priority!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls and not override:
        raise ValueError(
            f"a strategy named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__}); "
            "pass override=True to replace it"
        )
    _REGISTRY[cls.name] = cls
    return cls


def unregister_strategy(name: str) -> None:
    get_strategy_class(name)
    del _REGISTRY[name]


def available_strategies() -> List[str]:
    return sorted(_REGISTRY)


def get_strategy_class(name: str) -> Type[Strategy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown strategy {name!r}; available strategies: {', '.join(available_strategies())}"
        ) from None


def get_strategy(name: str) -> Strategy:
    return get_strategy_class(name)()


def strategies_by_priority() -> List[Type[Strategy]]:
    return sorted(_REGISTRY.values(), key=lambda cls: -cls.priority)
