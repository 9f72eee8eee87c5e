"""Name -> registration: a ``Strategy`` class, the constructor arguments its instances get, a description.

Third parties add theirs with ``register_strategy(MyStrategy)``, with arguments stored for every instance
the registry builds (``register_strategy(MyStrategy, mesh=tp_mesh)``), under another name with ``name=``
(one class, several configurations). Everything a registration needs is checked when it is made.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Type

from torch import nn

from .base import (
    SequenceParallelAware,
    Strategy,
    check_declarations,
    claims_only_with_process_group,
    process_group_ready,
)


@dataclass(frozen=True)
class Registration:
    """One registered strategy: its key, class, constructor arguments and description."""

    name: str
    cls: Type[Strategy]
    init_kwargs: Mapping[str, Any]
    description: str = ""
    # The instance "auto" resolves to where the class builds from its registered arguments alone (no
    # ``configures_from_runtime``): every call it claims shares it, as calls share a fixed instance.
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
        """The instance "auto" resolves for ``module`` (``Strategy.configured_for``)."""
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


class Order(List[Registration]):
    """Registrations highest priority first, made anew at each change of the registry (the resolver checks
    one by identity), and whether a class in it declares ``claims_from_layout``."""

    def __init__(self, entries: Iterable[Registration]):
        super().__init__(entries)
        self.reads_layout = any(entry.cls.claims_from_layout for entry in self)


# The resolver's order, and the same without the classes whose ``claims`` needs a process group.
_BY_PRIORITY = Order(())
_WITHOUT_PROCESS_GROUP = Order(())


def register_strategy(cls: Type[Strategy], override: bool = False, *, name: Optional[str] = None,
                      description: str = "", **init_kwargs: Any) -> Type[Strategy]:
    """Register a ``Strategy`` subclass under ``name`` (default ``cls.name``); every instance the registry
    builds from it gets ``init_kwargs``. Usable as a class decorator. Returns ``cls``."""
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise TypeError(f"register_strategy expects a subclass of tiled_mlp.Strategy, got {cls!r}")
    key = cls.name if name is None else name
    if not isinstance(key, str) or not key:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute `name` to be registered "
                        "(or be registered with name=...)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: it must define {missing}")
    problems = [p for method, args in _interface(cls).items() if (p := _interface_problem(cls, method, args))]
    if problems:
        raise TypeError(f"{cls.__name__} does not implement the Strategy interface: {'; '.join(problems)}")
    if not isinstance(cls.priority, int):
        raise TypeError(f"{cls.__name__}.priority must be an int, got {cls.priority!r}")
    check_declarations(cls)
    entry = Registration(key, cls, dict(init_kwargs), description or " ".join((vars(cls).get("__doc__") or "").split("\n\n")[0].split()))
    _check_init_kwargs(entry)
    held = _REGISTRY.get(key)
    if held is not None and not override and not _same(held, entry):
        raise ValueError(f"a strategy named {key!r} is already registered ({held.cls.__name__}"
                         f"{f' with {dict(held.init_kwargs)!r}' if held.init_kwargs else ''}); pass override=True "
                         "to replace it")
    _REGISTRY[key] = entry
    _reorder()
    return cls


def _same(a: Registration, b: Registration) -> bool:
    # Arguments compared by identity: a tensor or a process group has no usable ``==``.
    return (a.cls is b.cls and a.init_kwargs.keys() == b.init_kwargs.keys()
            and all(a.init_kwargs[k] is b.init_kwargs[k] for k in a.init_kwargs))


def _check_init_kwargs(entry: Registration) -> None:
    """Refuse, at registration, arguments the constructor cannot take, and required ones left out unless the
    class reads them from the runtime (``configures_from_runtime``)."""
    cls, signature = entry.cls, inspect.signature(entry.cls)
    try:
        signature.bind_partial(**entry.init_kwargs)
    except TypeError as error:
        raise TypeError(f"{cls.__name__}'s constructor cannot take the arguments registered under {entry.name!r} "
                        f"({dict(entry.init_kwargs)!r}): {error}") from None
    missing = [p.name for p in signature.parameters.values() if p.default is p.empty and p.name not in entry.init_kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing and not cls.configures_from_runtime:
        raise TypeError(f"{cls.__name__}'s constructor needs {', '.join(missing)}, which its registration "
                        f"{entry.name!r} does not give: register_strategy({cls.__name__}, "
                        f"{', '.join(f'{m}=...' for m in missing)}), or read them from the runtime in "
                        f"{cls.__name__}.configured_for")


def _interface(cls: Type[Strategy]) -> Dict[str, tuple]:
    """The methods a caller invokes on ``cls`` (the base class's, and its capability mixins'), with the
    positional arguments passed besides self/cls: an override must still accept that call."""
    bases = [Strategy] + ([SequenceParallelAware] if issubclass(cls, SequenceParallelAware) else [])
    out = {}
    for base in bases:
        for method, value in vars(base).items():
            if method.startswith("_") or not (isinstance(value, classmethod) or inspect.isfunction(value)):
                continue
            names = [p.name for p in inspect.signature(getattr(base, method)).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            out[method] = tuple(names if isinstance(value, classmethod) else names[1:])
    return out


def _interface_problem(cls: Type[Strategy], method: str, args: tuple) -> str:
    """Why ``cls.<method>`` cannot take the call the caller makes, or "" when it can."""
    if not callable(getattr(cls, method, None)):
        return f"{method} is not a method"
    on_class = isinstance(inspect.getattr_static(cls, method), (classmethod, staticmethod))
    if isinstance(inspect.getattr_static(Strategy, method, None), classmethod) and not on_class:
        return f"{method} must be a classmethod (the resolver asks the class before making an instance)"
    try:  # a plain function is called on an instance: bind ``self`` too
        inspect.signature(getattr(cls, method)).bind(*((None,) * (not on_class) + (object(),) * len(args)))
    except TypeError:
        return f"{method} must accept ({', '.join(args)})"
    return ""


def _reorder() -> None:
    global _BY_PRIORITY, _WITHOUT_PROCESS_GROUP
    _BY_PRIORITY = Order(sorted(_REGISTRY.values(), key=lambda entry: -entry.cls.priority))
    _WITHOUT_PROCESS_GROUP = Order(entry for entry in _BY_PRIORITY if not claims_only_with_process_group(entry.cls))


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
        raise KeyError(f"unknown strategy {name!r}; available strategies: {', '.join(available_strategies())}") from None


def get_strategy_class(name: str) -> Type[Strategy]:
    return _registration(name).cls


def get_strategy(name: str) -> Strategy:
    """An instance of the strategy registered under ``name``, with its stored constructor arguments."""
    return _registration(name).build()


def registrations_by_priority() -> Order:
    return _BY_PRIORITY


def claimable_registrations() -> Order:
    """The registrations "auto" may resolve to now, highest priority first: where no process group is
    initialised, none whose class needs one. The same list object until the registry changes."""
    return _BY_PRIORITY if process_group_ready() else _WITHOUT_PROCESS_GROUP
