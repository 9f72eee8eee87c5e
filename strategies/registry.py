"""Name -> Strategy class. Third parties add theirs with ``register_strategy(MyStrategy)``."""
from __future__ import annotations

import inspect
from typing import Dict, List, Type

from .base import Strategy

_REGISTRY: Dict[str, Type[Strategy]] = {}
# The resolver's order, kept sorted as classes come and go (it is read at every tiled call).
_BY_PRIORITY: List[Type[Strategy]] = []


def _reorder() -> None:
    _BY_PRIORITY[:] = sorted(_REGISTRY.values(), key=lambda cls: -cls.priority)


def register_strategy(cls: Type[Strategy], override: bool = False) -> Type[Strategy]:
    """Register a ``Strategy`` subclass under ``cls.name``; usable as a class decorator."""
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a subclass of tiled_mlp.Strategy, got {cls!r}")
    if not isinstance(cls.name, str) or not cls.name:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name` to be registered")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: it must define {missing}")
    problems = [p for p in (_interface_problem(cls, m, args) for m, args in _interface().items()) if p]
    if problems:
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: {'; '.join(problems)}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"{cls.__name__}.priority must be an int, got {cls.priority!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls and not override:
        raise ValueError(
            f"a strategy named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__}); "
            "pass override=True to replace it"
        )
    _REGISTRY[cls.name] = cls
    _reorder()
    return cls


def _interface() -> Dict[str, tuple]:
    """The base class's methods and the arguments the core passes them (besides self/cls): a
    subclass that overrides one must still accept that call."""
    out = {}
    for method, value in vars(Strategy).items():
        if method.startswith("_") or not isinstance(value, (classmethod, staticmethod)) and not inspect.isfunction(value):
            continue
        params = list(inspect.signature(getattr(Strategy, method)).parameters)
        out[method] = tuple(params if isinstance(value, staticmethod) else params[1:] if inspect.isfunction(value) else params)
    return out


def _interface_problem(cls: Type[Strategy], method: str, args: tuple) -> str:
    """Why ``cls.<method>`` cannot take the call the core makes, or "" when it can."""
    static = inspect.getattr_static(cls, method, None)
    if not callable(getattr(cls, method, None)):
        return f"{method} is not a method"
    on_class = isinstance(static, (classmethod, staticmethod))
    if isinstance(inspect.getattr_static(Strategy, method), classmethod) and not on_class:
        return f"{method} must be a classmethod (the resolver asks the class before making an instance)"
    # Plain functions are called on an instance: bind ``self`` too.
    bound_args = (object(),) * len(args) if on_class else (None,) + (object(),) * len(args)
    try:
        inspect.signature(getattr(cls, method)).bind(*bound_args)
    except TypeError:
        return f"{method} must accept ({', '.join(args)})"
    return ""


def unregister_strategy(name: str) -> None:
    get_strategy_class(name)
    del _REGISTRY[name]
    _reorder()


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
    return _BY_PRIORITY
