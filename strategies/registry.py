"""Name -> registration: a ``Strategy`` class, the constructor arguments its instances get, a description.
Everything a registration needs is checked when it is made."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type

from torch import nn

from .base import SequenceParallelAware, Strategy, check_declarations


@dataclass(frozen=True)
class Registration:
    name: str
    cls: Type[Strategy]
    init_kwargs: Mapping[str, Any]
    description: str = ""
    # The one instance "auto" resolves to where the class builds from its registered arguments alone.
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
        """The instance "auto" resolves for ``module``."""
        if self._shared:
            return self._shared[0]
        strategy = self._named(self.cls.configured_for(module, ancestors, **self.init_kwargs))
        if not self.cls.configures_from_runtime:
            self._shared.append(strategy)
        return strategy

    def _named(self, strategy: Strategy) -> Strategy:
        if strategy.name != self.name:
            strategy.name = self.name
        return strategy


_REGISTRY: Dict[str, Registration] = {}
# Highest priority first; a new list at every change of the registry (callers compare it by identity).
_BY_PRIORITY: List[Registration] = []


def register_strategy(cls: Type[Strategy], override: bool = False, *, name: Optional[str] = None,
                      description: str = "", **init_kwargs: Any) -> Type[Strategy]:
    """Register a ``Strategy`` subclass under ``name`` (default ``cls.name``); every instance the registry
    builds from it gets ``init_kwargs``. Usable as a class decorator."""
    global _BY_PRIORITY
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a subclass of tiled_mlp.Strategy, got {cls!r}")
    key = cls.name if name is None else name
    if not isinstance(key, str) or not key:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name` to be registered "
                        "(or be registered with name=...)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: it must define {missing}")
    problems = [problem for method in _interface(cls) if (problem := _interface_problem(cls, method))]
    if problems:
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: {'; '.join(problems)}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"{cls.__name__}.priority must be an int, got {cls.priority!r}")
    check_declarations(cls)
    _check_init_kwargs(cls, key, init_kwargs)
    held = _REGISTRY.get(key)
    # Arguments compared by identity: a tensor or a process group has no usable ``==``.
    same = held is not None and held.cls is cls and held.init_kwargs.keys() == init_kwargs.keys() and all(
        held.init_kwargs[k] is v for k, v in init_kwargs.items())
    if held is not None and not override and not same:
        raise ValueError(f"a strategy named {key!r} is already registered ({held.cls.__name__}"
                         f"{f' with {dict(held.init_kwargs)!r}' if held.init_kwargs else ''}); pass override=True "
                         "to replace it")
    _REGISTRY[key] = Registration(key, cls, dict(init_kwargs), description)
    _BY_PRIORITY = sorted(_REGISTRY.values(), key=lambda entry: -entry.cls.priority)
    return cls


def _check_init_kwargs(cls: Type[Strategy], key: str, init_kwargs: Dict[str, Any]) -> None:
    """Refuse arguments the constructor cannot take, and required ones left out unless the class reads them
    from the runtime (``configures_from_runtime``)."""
    signature = inspect.signature(cls)
    try:
        signature.bind_partial(**init_kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}'s constructor cannot take the arguments registered under {key!r} "
                        f"({init_kwargs!r}): {error}") from None
    missing = [p.name for p in signature.parameters.values() if p.default is p.empty and p.name not in init_kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing and not cls.configures_from_runtime:
        raise TypeError(f"{cls.__name__}'s constructor needs {', '.join(missing)}, which its registration "
                        f"{key!r} does not give: register_strategy({cls.__name__}, "
                        f"{', '.join(f'{m}=...' for m in missing)}), or read them from the runtime in "
                        f"{cls.__name__}.configured_for")


def _interface(cls: Type[Strategy]) -> List[str]:
    """The public methods callers invoke on ``cls``: the base class's and its capability mixins'."""
    bases = [Strategy, SequenceParallelAware][:1 + issubclass(cls, SequenceParallelAware)]
    return [method for base in bases for method, value in vars(base).items()
            if not method.startswith("_") and (isinstance(value, classmethod) or inspect.isfunction(value))]


def _interface_problem(cls: Type[Strategy], method: str) -> str:
    """Why ``cls.<method>`` cannot take the call the base class's signature promises, or "" when it can."""
    if not callable(getattr(cls, method, None)):
        return f"{method} is not a method"
    base = next(b for b in (Strategy, SequenceParallelAware) if method in vars(b))
    base_is_class = isinstance(vars(base)[method], classmethod)
    on_class = isinstance(inspect.getattr_static(cls, method), (classmethod, staticmethod))
    if base_is_class and not on_class:
        return f"{method} must be a classmethod (the resolver asks the class before making an instance)"
    args = [p.name for p in inspect.signature(getattr(base, method)).parameters.values()
            if p.kind == p.POSITIONAL_OR_KEYWORD][0 if base_is_class else 1:]
    try:  # a plain function is called on an instance: bind ``self`` too
        inspect.signature(getattr(cls, method)).bind(*((None,) * (not on_class) + (object(),) * len(args)))
    except TypeError:
        return f"{method} must accept ({', '.join(args)})"
    return ""


def unregister_strategy(name: str) -> None:
    global _BY_PRIORITY
    _registration(name)
    del _REGISTRY[name]
    _BY_PRIORITY = [entry for entry in _BY_PRIORITY if entry.name != name]


def available_strategies() -> List[str]:
    return sorted(_REGISTRY)


def _registration(name: str) -> Registration:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; available strategies: {', '.join(available_strategies())}") from None


def get_strategy_class(name: str) -> Type[Strategy]:
    return _registration(name).cls


def get_strategy(name: str) -> Strategy:
    """An instance of the strategy registered under ``name``, with its stored constructor arguments."""
    return _registration(name).build()


def registrations_by_priority() -> List[Registration]:
    return _BY_PRIORITY
