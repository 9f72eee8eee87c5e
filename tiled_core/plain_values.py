"""The Python values a module tree's code may read from its attributes, which the generic path's recompute
would read again (strict mode only; docs/architecture.md, "Strict mode"): every attribute load and string
constant in the code of the tree's classes, instance forwards, and same-file functions they reach by name. They
have no version counter, so they are compared as autograd compares a saved tensor's: plain values by value, other
objects by identity.
"""
from __future__ import annotations

import dis
import enum
import types
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
from torch import nn

from . import strict as _strict

VALUE_CHANGED_ERROR = (
    "one of the values needed for gradient computation has been changed: {name} of {module} is {now}; expected "
    "{then} instead. The forward of {module} may read it, and the backward recomputes that forward (TiledMLP), so "
    "it would compute with the new value and its gradients would be wrong. Change it after the backward (or "
    "before the forward); if the forward itself changes it, run this module untiled (untile(module))."
)
VALUE_CHANGED_BY_FORWARD_ERROR = (
    "TiledMLP: the forward of {module} changes {name} at every call (it was {before} before the forward, {now} "
    "after its first shard was run twice). The backward recomputes each shard's forward, which would read another "
    "value than that shard's forward did, so its gradients would be wrong. Change the value between steps, not "
    "in the forward, or run this module untiled (untile(module))."
)
# Immutable values compared by value: two equal ones compute the same (``torch.device`` and
# ``torch.Size`` objects are made anew at each read, equal but not identical).
_PLAIN = (int, float, bool, complex, str, type(None), torch.device, torch.dtype, enum.Enum)
# The tiling machinery's own classes (the ``Tiled<Name>`` subclass and its base).
_OWN_PACKAGE = __name__.rpartition(".")[0] + "."


def is_plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):  # torch.Size and named tuples too
        return all(is_plain(item) for item in value)
    return isinstance(value, _PLAIN)


# ``nn.Module``'s own registries and hook dicts: changed in place, never rebound, and covered by the
# plan's key and the hook check. ``training`` is a setting the computation reads.
_MODULE_BOOKKEEPING = frozenset(vars(nn.Module())) - {"training"}
# Tensors (by version and by the Function's inputs) and submodules (by the plan's key) are compared elsewhere.
_CHECKED_ELSEWHERE = (torch.Tensor, nn.Module)


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


def _function(value: Any) -> Optional[types.FunctionType]:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    value = getattr(value, "__func__", value)  # a bound method
    return value if isinstance(value, types.FunctionType) else None


def _names_read(functions: List[Optional[types.FunctionType]]) -> Set[str]:
    """The attribute names and string constants in the code of ``functions``, of the code nested in it
    (comprehensions, lambdas) and of the plain functions of their own source module they reach by a global name
    (a helper written beside the class; not every library function the code calls)."""
    names: Set[str] = set()
    seen: Set[types.CodeType] = set()
    pending = [(function.__code__, function) for function in functions if function is not None]
    while pending:
        code, func = pending.pop()
        if code in seen:
            continue
        seen.add(code)
        for instruction in dis.get_instructions(code):
            if instruction.opname in _ATTRIBUTE_LOADS and isinstance(instruction.argval, str):
                names.add(instruction.argval)
            elif instruction.opname == "LOAD_GLOBAL":
                target = func.__globals__.get(instruction.argval)
                if isinstance(target, types.FunctionType) and target.__module__ == func.__module__:
                    pending.append((target.__code__, target))
        names.update(const for const in code.co_consts if isinstance(const, str))
        pending += [(const, func) for const in code.co_consts if isinstance(const, types.CodeType)]
    return names


# Which values the tree's code may read: every name it reads, and (prefix, ``__dict__``) of each module, the root's
# through a weak reference to the root: a plan in the root's own state keeps this, and the root's dict held would be
# a cycle outliving ``del model`` (the call's kernel holds the root until its backward).
ReadSet = Tuple[FrozenSet[str], List[Tuple[str, Any]]]


def snapshot(module: nn.Module, root_forward: Optional[Callable] = None) -> ReadSet:
    """Which values the code of ``module``'s tree may read (none outside strict mode). ``root_forward``: what
    ``module``'s forward runs where it is not its class's."""
    if not _strict.ON:
        return frozenset(), []
    functions: List[Optional[types.FunctionType]] = []
    modules: List[Tuple[str, Any]] = []
    for prefix, sub in module.named_modules():  # a class's code is read once (``_names_read`` skips code seen)
        modules.append((prefix, sub.__dict__ if prefix else weakref.ref(sub)))
        # The tiling machinery's own classes are not the module's computation: the recompute does not run them.
        functions += [_function(function) for klass in type(sub).__mro__
                      if klass not in (nn.Module, object) and not klass.__module__.startswith(_OWN_PACKAGE)
                      for value in vars(klass).values()
                      for function in ((value.fget, value.fset) if isinstance(value, property) else (value,))]
        functions.append(_function(root_forward if not prefix else sub.__dict__.get("forward")))
    return frozenset(_names_read(functions)) - _MODULE_BOOKKEEPING, modules


_UNSET = object()


def _shown(value: Any, by_identity: bool) -> str:
    if value is _UNSET:
        return "unset"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"another {type(value).__name__} object, {text}" if by_identity else text


def _dicts(read: ReadSet) -> List[Dict[str, Any]]:
    return [held if prefix else held().__dict__ for prefix, held in read[1]]


class PlainValues:
    """The values the module tree's code may read (``read``: which, from ``snapshot``) as they are
    when made, to be compared later: plain values by value, other objects by identity."""

    def __init__(self, read: ReadSet):
        self.read = read
        names, modules = read
        dicts = _dicts(read)
        self.attrs = [frozenset(d) for d in dicts]
        self.entries = [(f"{prefix}.{attr}" if prefix else attr, index, attr, d[attr], not is_plain(d[attr]))
                        for index, ((prefix, _), d) in enumerate(zip(modules, dicts, strict=True))
                        for attr in sorted(names.intersection(d)) if not isinstance(d[attr], _CHECKED_ELSEWHERE)]

    def changed(self) -> List[Tuple[str, Any, Any, bool]]:
        """(qualified name, value then, value now, compared by identity) of each value that changed."""
        out = []
        dicts = _dicts(self.read)
        for name, index, attr, then, by_identity in self.entries:
            now = dicts[index].get(attr, _UNSET)
            if now is not then and (now is _UNSET or by_identity or not same_value(then, now)):
                out.append((name, then, now, by_identity))
        names, modules = self.read
        for (prefix, _), d, attrs in zip(modules, dicts, self.attrs, strict=True):
            for attr in sorted(names.intersection(d.keys() - attrs)):
                if not isinstance(d[attr], _CHECKED_ELSEWHERE):
                    out.append((f"{prefix}.{attr}" if prefix else attr, _UNSET, d[attr], False))
        return out

    def check(self, where: str) -> None:
        changed = self.changed()
        if changed:
            name, then, now, by_identity = changed[0]
            then_shown = f"the {type(then).__name__} object it was, {_shown(then, False)}" if by_identity else _shown(then, False)
            raise RuntimeError(VALUE_CHANGED_ERROR.format(name=name, module=where, now=_shown(now, by_identity),
                                                          then=then_shown))

    def check_settled(self, where: str, before: PlainValues) -> None:
        """Refuse a forward that changed a value again when its first shard was run a second time."""
        changed = self.changed()
        if changed:
            name, _, now, by_identity = changed[0]
            first = next((then for n, then, _, _ in before.changed() if n == name), _UNSET)
            raise RuntimeError(VALUE_CHANGED_BY_FORWARD_ERROR.format(
                name=name, module=where, before=_shown(first, False), now=_shown(now, by_identity)))
