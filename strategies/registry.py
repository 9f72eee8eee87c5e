"""Name -> registration: a ``Strategy`` class and the constructor arguments its instances get.

Third parties add theirs with ``register_strategy(MyStrategy)``, or with arguments stored for every
instance the registry builds: ``register_strategy(MyStrategy, mesh=tp_mesh)``, under another name with
``name=`` (one class, several configurations).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

from torch import nn

from .base import SequenceParallelAware, Strategy, claims_only_with_process_group, process_group_ready


@dataclass(frozen=True)
class Registration:
    """One registered strategy: the key it is found by, its class, and its constructor arguments."""

    name: str
    cls: Type[Strategy]
    init_kwargs: Mapping[str, Any]
    # The instance "auto" resolves to, kept where the class builds it from the registered arguments alone (its
    # ``configured_for`` is the base class's): nothing of the runtime goes into it, so every call it claims
    # shares it, as every call of a module given a fixed instance shares that one.
    _shared: List[Strategy] = field(default_factory=list, compare=False, repr=False)

    def build(self) -> Strategy:
        """An instance configured with the stored arguments alone (a name given to ``TiledMLP``)."""
        try:
            inspect.signature(self.cls).bind(**self.init_kwargs)
        except TypeError as error:
            raise TypeError(f"{self.cls.__name__} cannot be built from its registration {self.name!r} "
                            f"({dict(self.init_kwargs)!r}): {error}. Register it with its arguments: "
                            f"register_strategy({self.cls.__name__}, name=..., arg=value)") from None
        return self._named(self.cls(**self.init_kwargs))

    def build_for(self, module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> Strategy:
        """The instance "auto" resolves for ``module``: the stored arguments, and what the class reads
        from the runtime for the rest (``Strategy.configured_for``)."""
        shared = self._shared
        if shared:
            return shared[0]
        strategy = self._named(self.cls.configured_for(module, ancestors, **self.init_kwargs))
        if getattr(self.cls.configured_for, "__func__", None) is _BASE_CONFIGURED_FOR:
            shared.append(strategy)
        return strategy

    def _named(self, strategy: Strategy) -> Strategy:
        if strategy.name != self.name:
            strategy.name = self.name
        return strategy


# The base class's ``configured_for``, as defined: a class that keeps it builds from its arguments alone.
_BASE_CONFIGURED_FOR = Strategy.__dict__["configured_for"].__func__

_REGISTRY: Dict[str, Registration] = {}
# The resolver's order, kept sorted as registrations come and go (it is read at every tiled call), and the
# same without the classes whose ``claims`` needs a process group (``claims_need_process_group``), read where
# none is initialised: each class is read at registration, as its ``priority`` is.
_BY_PRIORITY: List[Registration] = []
_WITHOUT_PROCESS_GROUP: List[Registration] = []


def _reorder() -> None:
    _BY_PRIORITY[:] = sorted(_REGISTRY.values(), key=lambda entry: -entry.cls.priority)
    _WITHOUT_PROCESS_GROUP[:] = [entry for entry in _BY_PRIORITY if not claims_only_with_process_group(entry.cls)]


def register_strategy(cls: Type[Strategy], override: bool = False, *, name: Optional[str] = None,
                      **init_kwargs: Any) -> Type[Strategy]:
    """Register a ``Strategy`` subclass under ``name`` (default ``cls.name``); every instance the registry
    builds from it (by name, or when "auto" resolves it) gets ``init_kwargs``. Usable as a class
    decorator. Returns ``cls``."""
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a subclass of tiled_mlp.Strategy, got {cls!r}")
    key = cls.name if name is None else name
    if not isinstance(key, str) or not key:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name` to be registered "
                        "(or be registered with name=...)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: it must define {missing}")
    problems = [p for base in _interfaces_of(cls) for m, args in _interface(base).items()
                for p in [_interface_problem(cls, base, m, args)] if p]
    if problems:
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: {'; '.join(problems)}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"{cls.__name__}.priority must be an int, got {cls.priority!r}")
    _check_init_kwargs(cls, key, init_kwargs)
    entry = Registration(key, cls, dict(init_kwargs))
    if not override and key in _REGISTRY and not _same_registration(_REGISTRY[key], entry):
        held = _REGISTRY[key]
        raise ValueError(
            f"a strategy named {key!r} is already registered ({held.cls.__name__}"
            f"{_shown(held.init_kwargs)}); pass override=True to replace it"
        )
    _REGISTRY[key] = entry
    _reorder()
    return cls


def _same_registration(a: Registration, b: Registration) -> bool:
    # Arguments compared by identity: a tensor or a process group has no usable ``==``.
    return (a.cls is b.cls and a.init_kwargs.keys() == b.init_kwargs.keys()
            and all(a.init_kwargs[k] is b.init_kwargs[k] for k in a.init_kwargs))


def _shown(init_kwargs: Mapping[str, Any]) -> str:
    return f" with {dict(init_kwargs)!r}" if init_kwargs else ""


def _check_init_kwargs(cls: Type[Strategy], key: str, init_kwargs: Mapping[str, Any]) -> None:
    """Refuse, at registration rather than at the first forward, arguments the constructor cannot take.
    Required ones may be left out: "auto" can read them from the runtime (``Strategy.configured_for``)."""
    try:
        inspect.signature(cls).bind_partial(**init_kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}'s constructor cannot take the arguments registered under {key!r} "
                        f"({dict(init_kwargs)!r}): {error}") from None


def _interfaces_of(cls: Type[Strategy]) -> List[type]:
    """The interfaces ``cls`` must honour: the base class, and each capability mixin it opts into."""
    return [Strategy] + ([SequenceParallelAware] if issubclass(cls, SequenceParallelAware) else [])


def _interface(base: type) -> Dict[str, tuple]:
    """``base``'s methods and the positional arguments the caller passes them (besides self/cls): a
    subclass that overrides one must still accept that call."""
    out = {}
    for method, value in vars(base).items():
        if method.startswith("_") or not isinstance(value, (classmethod, staticmethod)) and not inspect.isfunction(value):
            continue
        params = [p for p in inspect.signature(getattr(base, method)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [p.name for p in params]
        out[method] = tuple(names if isinstance(value, staticmethod) else names[1:] if inspect.isfunction(value) else names)
    return out


def _interface_problem(cls: Type[Strategy], base: type, method: str, args: tuple) -> str:
    """Why ``cls.<method>`` cannot take the call the caller makes, or "" when it can."""
    static = inspect.getattr_static(cls, method, None)
    if not callable(getattr(cls, method, None)):
        return f"{method} is not a method"
    on_class = isinstance(static, (classmethod, staticmethod))
    if isinstance(inspect.getattr_static(base, method), classmethod) and not on_class:
        return f"{method} must be a classmethod (the resolver asks the class before making an instance)"
    # Plain functions are called on an instance: bind ``self`` too.
    bound_args = (object(),) * len(args) if on_class else (None,) + (object(),) * len(args)
    try:
        inspect.signature(getattr(cls, method)).bind(*bound_args)
    except TypeError:
        return f"{method} must accept ({', '.join(args)})"
    return ""


def unregister_strategy(name: str) -> None:
    _registration(name)
    del _REGISTRY[name]
    _reorder()


def available_strategies() -> List[str]:
    return sorted(_REGISTRY)


def _registration(name: str) -> Registration:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown strategy {name!r}; available strategies: {', '.join(available_strategies())}"
        ) from None


def get_strategy_class(name: str) -> Type[Strategy]:
    return _registration(name).cls


def get_strategy(name: str) -> Strategy:
    """An instance of the strategy registered under ``name``, with its stored constructor arguments."""
    return _registration(name).build()


def registrations_by_priority() -> List[Registration]:
    return _BY_PRIORITY


def claimable_registrations() -> List[Registration]:
    """The registrations "auto" may resolve to now, highest priority first: where no process group is
    initialised, none whose class needs one."""
    return _BY_PRIORITY if process_group_ready() else _WITHOUT_PROCESS_GROUP
