"""The plain Python values a module tree's code may read from its attributes: what the generic path's
backward recompute would read again.

A tensor attribute has a version counter (``checks.TensorVersions``); a Python value does not. A
``self.scale = 2.0`` rebound between a forward and its backward would silently be read anew by the
recompute. So the values the forward could read are taken with the forward (``checks.PlainValues``)
and compared when the backward starts.

Which values: an attribute in a module's ``__dict__``, for the module and every submodule, that is

- plain: an ``int``, ``float``, ``bool``, ``complex``, ``str`` (``GELU.approximate``), ``None`` (an optional
  setting left unset, which a forward branches on), or a tuple of those. All immutable, so holding the
  object holds its value. A list or dict is left out: its contents change without the attribute being
  rebound, so it would have to be copied at every call;
- read by the code of the module's class (any method of the class and its bases, ``nn.Module`` itself
  excepted) or of an instance ``forward``: an attribute load of that name, or the name as a string
  constant (``getattr(self, "scale")``). That keeps out what the module's code never reads but a backend
  changes between forward and backward (ZeRO-3 counts pending gradients in ``ds_grads_remaining`` on
  each module), what ``__init__`` only stores, and ``nn.Module``'s own bookkeeping; ``training`` is kept
  where the class reads it (``Dropout``).

Not seen: a value read through another object (``self.config.scale``), or a class attribute.
"""
from __future__ import annotations

import dis
import functools
import types
from typing import Any, Callable, FrozenSet, Iterator, List, Optional, Set, Tuple

from torch import nn

_PLAIN = (int, float, bool, complex, str, type(None))


def is_plain(value: Any) -> bool:
    if type(value) is tuple:
        return all(is_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def same_value(then: Any, now: Any) -> bool:
    """Equal and of the same type (``2`` and ``2.0`` compute differently on an integer tensor); NaN
    equals NaN (a value that was NaN and still is did not change)."""
    if then is now:
        return True
    if type(then) is not type(now):
        return False
    if type(then) is tuple:
        return len(then) == len(now) and all(same_value(a, b) for a, b in zip(then, now, strict=True))
    return bool(then == now) or (then != then and now != now)


# The instructions that read an attribute by name (``LOAD_METHOD``: Python 3.11; ``LOAD_SUPER_ATTR``: 3.12+).
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"})


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> FrozenSet[str]:
    """Cached by code object (immutable; a method patched later is another one): disassembling is about
    a millisecond per class, and a plan is made again whenever an attribute is rebound."""
    names: Set[str] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _ATTRIBUTE_LOADS and isinstance(instruction.argval, str):
            names.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, types.CodeType):  # nested functions, comprehensions, lambdas
            names |= _code_names(const)
    return frozenset(names)


def _function_code(value: Any) -> Optional[types.CodeType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    value = getattr(value, "__func__", value)  # a bound method
    code = getattr(value, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def names_read_by(cls: type, instance_forward: Optional[Callable] = None) -> Set[str]:
    """Every attribute name the code of ``cls`` (and its bases below ``nn.Module``) and ``instance_forward``
    loads, and every string constant in it."""
    names: Set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        for value in vars(klass).values():
            functions = (value.fget, value.fset) if isinstance(value, property) else (value,)
            for function in functions:
                code = _function_code(function)
                if code is not None:
                    names |= _code_names(code)
    if instance_forward is not None:
        code = _function_code(instance_forward)
        if code is not None:
            names |= _code_names(code)
    return names


def plain_attributes(module: nn.Module, root_forward: Optional[Callable] = None
                     ) -> Iterator[Tuple[str, dict, str, Any]]:
    """(qualified name, the owning module's ``__dict__``, attribute, value) of each plain value the code
    of ``module``'s tree may read. ``root_forward``: what ``module``'s forward runs where it is not its
    class's (an instance forward)."""
    for prefix, sub in module.named_modules():
        d = sub.__dict__
        names = names_read_by(type(sub), root_forward if not prefix else d.get("forward"))
        for attr in sorted(names.intersection(d)):
            value = d[attr]
            if is_plain(value):
                yield (f"{prefix}.{attr}" if prefix else attr), d, attr, value


def snapshot(module: nn.Module, root_forward: Optional[Callable] = None) -> List[Tuple[str, dict, str, Any]]:
    return list(plain_attributes(module, root_forward))
