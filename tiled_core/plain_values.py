"""The Python values a module tree's code may read from its attributes: what the generic path's backward
recompute would read again.

A tensor attribute has a version counter (``checks.TensorVersions``); a Python value does not. A
``self.scale = 2.0`` rebound between a forward and its backward would silently be read anew by the
recompute. So the values the forward could read are taken with the forward (``checks.PlainValues``)
and compared when the backward starts.

Which names: every name the code of the tree reads, taken together for the whole tree (a parent's
forward may read ``self.down.out_scale``, a value held on its child): attribute loads and string
constants (``getattr(self, "scale")``) in every method of each module's class and its bases
(``nn.Module`` itself and this library's tiling classes excepted), in an instance ``forward``, and in
the plain functions of the same source file those reach by a global name (a module-level helper
called with ``self``), followed transitively. That keeps out what the code never reads but a backend changes between forward
and backward (ZeRO-3 counts pending gradients in ``ds_grads_remaining`` on each module), what
``__init__`` only stores, and ``nn.Module``'s own bookkeeping; ``training`` is kept where a class in the
tree reads it (``Dropout``).

Which values, of those names, in each module's ``__dict__``:

- plain ones: an ``int``, ``float``, ``bool``, ``complex``, ``str`` (``GELU.approximate``), ``None`` (an
  optional setting left unset, which a forward branches on), or a tuple of those, compared by value
  (immutable, so holding the object holds its value);
- any other object but a tensor or a module (those have their own checks), compared by identity: PEFT
  holds the active adapter in a list that ``set_adapter`` rebinds. A list or dict changed in place is
  not seen (seeing it would mean copying its contents at every call);
- a name the code reads that the module did not have and has now (a setting created lazily).

Not seen: a value read through another object (``self.config.scale``) or an attribute of an object
held in a local variable, a class attribute, a name built at run time (``getattr(self, prefix + "x")``),
code reached otherwise than by a global name of its own file (a helper imported from another file, a
method of another object, a closure passed in).
"""
from __future__ import annotations

import dis
import enum
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import nn

from . import strict as _strict

# Immutable values compared by value: two equal ones compute the same (``torch.device`` and
# ``torch.Size`` objects are made anew at each read, equal but not identical).
_PLAIN = (int, float, bool, complex, str, type(None), torch.device, torch.dtype, enum.Enum)
# The tiling machinery's own classes (the ``Tiled<Name>`` subclass and its base): its code is not the
# module's computation and the recompute does not run it.
_OWN_PACKAGE = __name__.rpartition(".")[0] + "."


def is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):  # torch.Size and named tuples too
        return all(is_plain(item) for item in value)
    return isinstance(value, _PLAIN)


# ``nn.Module``'s own registries and hook dicts: changed in place, never rebound, and covered by the
# plan's key and the hook check. ``training`` is a setting the computation reads.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}


def is_checked_elsewhere(value: Any) -> bool:
    """Tensors (version counters, ``TensorReads``) and modules (walked themselves)."""
    return isinstance(value, (torch.Tensor, nn.Module))


def same_value(then: Any, now: Any) -> bool:
    """Equal and of the same type (``2`` and ``2.0`` compute differently on an integer tensor); NaN
    equals NaN (a value that was NaN and still is did not change)."""
    if then is now:
        return True
    if type(then) is not type(now):
        return False
    if isinstance(then, tuple):
        return len(then) == len(now) and all(same_value(a, b) for a, b in zip(then, now, strict=True))
    return bool(then == now) or (then != then and now != now)


# The instructions that read an attribute by name (``LOAD_METHOD``: Python 3.11; ``LOAD_SUPER_ATTR``: 3.12+).
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """(attribute names and string constants, global names) read by ``code``. Cached by code object
    (immutable; a method patched later is another one): disassembling is about a millisecond per class."""
    names: Set[str] = set()
    globals_read: Set[str] = set()
    for instruction in dis.get_instructions(code):
        if not isinstance(instruction.argval, str):
            continue
        if instruction.opname in _ATTRIBUTE_LOADS:
            names.add(instruction.argval)
        elif instruction.opname == "LOAD_GLOBAL":
            globals_read.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, types.CodeType):  # nested functions, comprehensions, lambdas
            inner_names, inner_globals = _code_names(const)
            names |= inner_names
            globals_read |= inner_globals
    return frozenset(names), frozenset(globals_read)


def _function(value: Any) -> Optional[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    value = getattr(value, "__func__", value)  # a bound method
    return value if isinstance(value, types.FunctionType) else None


class _NameCollector:
    """The names read by a set of functions and the plain functions they reach by a global name."""

    def __init__(self) -> None:
        self.names: Set[str] = set()
        self._seen: Set[types.CodeType] = set()

    def add(self, function: Optional[types.FunctionType]) -> None:
        pending = [function] if function is not None else []
        while pending:
            func = pending.pop()
            code = func.__code__
            if code in self._seen:
                continue
            self._seen.add(code)
            names, globals_read = _code_names(code)
            self.names |= names
            for global_name in globals_read:
                target = func.__globals__.get(global_name)
                # Only within the same source module: a helper written beside the class, not a walk
                # through every library function the code calls (they do not read the module's attributes).
                if isinstance(target, types.FunctionType) and target.__module__ == func.__module__:
                    pending.append(target)

    def add_class(self, cls: type) -> None:
        self.names |= _class_names(cls)


def _own_classes(cls: type) -> List[type]:
    return [klass for klass in cls.__mro__
            if klass not in (nn.Module, object) and not klass.__module__.startswith(_OWN_PACKAGE)]


def _class_names(cls: type) -> FrozenSet[str]:
    collector = _NameCollector()
    for klass in _own_classes(cls):
        for value in vars(klass).values():
            for function in ((value.fget, value.fset) if isinstance(value, property) else (value,)):
                collector.add(_function(function))
    return frozenset(collector.names)


# (qualified name, the owning module's ``__dict__``, attribute, value, compared by identity)
Entry = Tuple[str, Dict[str, Any], str, Any, bool]


@dataclass(frozen=True)
class ReadValues:
    """What the tree's code may read, as it is when taken."""

    names: FrozenSet[str]  # every name the tree's code reads
    # (prefix, the module's ``__dict__``, its attribute names when taken): one per module
    modules: List[Tuple[str, Dict[str, Any], FrozenSet[str]]]
    entries: List[Entry]

    def retaken(self) -> ReadValues:
        """The same names, read again now."""
        return _read(self.names, [(prefix, d) for prefix, d, _ in self.modules])


def _read(names: FrozenSet[str], modules: List[Tuple[str, Dict[str, Any]]]) -> ReadValues:
    entries: List[Entry] = []
    for prefix, d in modules:
        for attr in sorted(names.intersection(d)):
            value = d[attr]
            if not is_checked_elsewhere(value):
                entries.append((f"{prefix}.{attr}" if prefix else attr, d, attr, value, not is_plain(value)))
    return ReadValues(names, [(prefix, d, frozenset(d)) for prefix, d in modules], entries)


def snapshot(module: nn.Module, root_forward: Optional[Callable] = None) -> ReadValues:
    """The values the code of ``module``'s tree may read. ``root_forward``: what ``module``'s forward runs
    where it is not its class's (an instance forward). Read in strict mode only (``strict.py``): else none."""
    if not _strict.ON:
        return ReadValues(frozenset(), [], [])
    collector = _NameCollector()
    classes: Set[type] = set()
    modules: List[Tuple[str, Dict[str, Any]]] = []
    for prefix, sub in module.named_modules():
        d = sub.__dict__
        modules.append((prefix, d))
        if type(sub) not in classes:
            classes.add(type(sub))
            collector.add_class(type(sub))
        collector.add(_function(root_forward if not prefix else d.get("forward")))
    return _read(frozenset(collector.names) - _MODULE_BOOKKEEPING, modules)
