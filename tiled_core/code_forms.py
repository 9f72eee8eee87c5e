"""Is a function exactly a given body of code? Decided by its bytecode, never by running it: a numeric probe
cannot prove that a forward computes a formula (a clamp random inputs never reach, a branch on grad mode).
The body is compiled on the running interpreter with the function's argument name and docstring, and the
code objects are compared field by field; the module globals the body names are checked by ``globals_hold``.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .kernel_registry import GENERATION

_COMPARED = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_posonlyargcount",
             "co_kwonlyargcount", "co_freevars", "co_cellvars")
# The flags of what kind of code it is, without the ``__future__`` bits and CO_NESTED: those say where the
# code was written, not what it does.
_KIND_FLAGS = 0xFFFF & ~inspect.CO_NESTED


@dataclass(frozen=True)
class CodeForm:
    """A method body, ``{x}`` standing for its one argument besides ``self``; ``globals`` maps each
    module-level name the body loads, and each attribute it calls on one (``"F.silu"``), to the object
    it must be: a module is the same object while one of its functions is monkeypatched."""

    body: str
    globals: Mapping[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def global_paths(self) -> Tuple[Tuple[str, Tuple[str, ...], Any], ...]:
        return tuple((head, tuple(attrs), obj) for path, obj in self.globals.items()
                     for head, *attrs in (path.split("."),))


def _compiled(form: CodeForm, arg: str, doc: Optional[str]) -> types.CodeType:
    # Each global is declared as an import, as the libraries bind them: CPython compiles a call on an
    # imported name (``F.silu(...)``) with other instructions than a call on any other global.
    lines = [f"import {name}" for name in dict.fromkeys(path.split(".")[0] for path in form.globals)]
    lines.append(f"def forward(self, {arg}):")
    if doc is not None:
        lines.append(f"    {doc!r}")
    lines += [f"    {line}" for line in form.body.format(x=arg).splitlines()]
    module = compile("\n".join(lines), "<code form>", "exec", dont_inherit=True)
    (code,) = [c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == "forward"]
    return code


def check_body(form: CodeForm, registration: str) -> None:
    """Refuse, before it is registered anywhere, a body that is not a ``CodeForm`` compiling as a method body."""
    if not isinstance(form, CodeForm):
        raise TypeError(f"{registration} takes a CodeForm body, got {type(form).__name__}")
    try:
        _compiled(form, "x", None)
    except SyntaxError as error:
        raise ValueError(f"not a method body ({{x}} standing for its argument): {form.body!r}: {error.msg}") from None


# (id of code, id of form) -> (code, form, whether the code is the form's): both kept alive by the entry, so
# no id is reused; a forward whose ``__code__`` is replaced (IPython's autoreload) is checked again.
_CACHE: Dict[Tuple[int, int], Tuple[types.CodeType, CodeForm, bool]] = {}
_MISSING = object()


def matches(fn: Any, form: CodeForm) -> bool:
    """Whether ``fn`` is a plain two-argument function whose code is exactly ``form``'s body."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ is not None:
        return False
    code = fn.__code__
    key = (id(code), id(form))
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not code or cached[1] is not form:
        cached = _CACHE[key] = (code, form, same_code(code, form, fn.__doc__))
    return cached[2] and globals_hold(fn, form)


def same_code(code: types.CodeType, form: CodeForm, doc: Optional[str]) -> bool:
    if code.co_argcount != 2 or code.co_kwonlyargcount:
        return False
    want = _compiled(form, code.co_varnames[1], doc)
    return (all(getattr(code, name) == getattr(want, name) for name in _COMPARED)
            # By type as well as value: 1 == 1.0 == True and 0.0 == -0.0 for ``==``, not for ``repr``.
            and repr(code.co_consts) == repr(want.co_consts)
            and code.co_flags & _KIND_FLAGS == want.co_flags & _KIND_FLAGS)


def globals_hold(fn: types.FunctionType, form: CodeForm) -> bool:
    """Whether the module globals ``fn`` reads are still the objects ``form`` names (rebindable after the match)."""
    for head, attrs, obj in form.global_paths:
        value = fn.__globals__.get(head, _MISSING)
        for attr in attrs:
            value = getattr(value, attr, _MISSING)
        if value is not obj:
            return False
    return True


def replace_body(table: List[Tuple[CodeForm, Any]], body: CodeForm, value: Any = None, registration: str = "") -> None:
    """Withdraw ``body`` (an equal one) from a registry of bodies, then register it with ``value`` if given
    (by ``registration``: refused, before any change, where ``check_body`` refuses it)."""
    if value is not None:
        check_body(body, registration)
    table[:] = [(known, known_value) for known, known_value in table if known != body]
    if value is not None:
        table.append((body, value))
    GENERATION[0] += 1


def first_match(table: List[Tuple[CodeForm, Any]], fn: Any) -> Any:
    """The value of the first registered body ``fn``'s code is; None when none."""
    return next((value for body, value in table if matches(fn, body)), None)
