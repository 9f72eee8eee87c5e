"""Is a function exactly a given body of code? Decided by its bytecode, not by running it.

A numeric probe cannot prove a forward computes a formula (a clamp random inputs never reach, a branch on
grad mode, a factor within bf16's tolerance of 1). ``matches(fn, form)`` compiles the form's body on the running
interpreter with ``fn``'s argument name and docstring and compares the code objects field by field: a patched,
wrapped or edited forward is other code. What the code reads through ``self`` is checked by the caller
(``gated_forms``); the module globals it names, by ``globals_hold``.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

_COMPARED = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_posonlyargcount",
             "co_kwonlyargcount", "co_freevars", "co_cellvars")
# The flags of what kind of code it is (optimized, generator, varargs, ...). Not compared: the
# ``__future__`` bits above them (how the module was compiled: ``from __future__ import annotations``)
# and CO_NESTED (a class defined inside a function), which say where the code was written, not what
# the body does.
_KIND_FLAGS = 0xFFFF & ~inspect.CO_NESTED


@dataclass(frozen=True)
class CodeForm:
    """A method body, ``{x}`` standing for its one argument besides ``self``; ``globals`` maps each
    module-level name the body loads, and each attribute it calls on one (``"F.silu"``), to the object
    it must be: a module is the same object while one of its functions is monkeypatched."""

    body: str
    globals: Mapping[str, Any] = field(default_factory=dict)

    # Each global's path split once (``globals_hold`` reads them at every call that relies on a match); a
    # form is not changed once used, as the match cache below also assumes.
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


def check_body(form: CodeForm) -> None:
    """Refuse, before it is registered anywhere, a body that does not compile as a method body."""
    try:
        _compiled(form, "x", None)
    except SyntaxError as error:
        raise ValueError(f"not a method body ({{x}} standing for its argument): {form.body!r}: {error.msg}") from None


# (code, form) -> whether the code is the form's. Keyed on the code object, which is immutable: a
# forward whose ``__code__`` is replaced (IPython's autoreload does it) is checked again. Both are kept
# alive by the entry, so their ids cannot be reused; the table is cleared past a bound.
_CACHE: Dict[Tuple[int, int], Tuple[types.CodeType, CodeForm, bool]] = {}
_CACHE_LIMIT = 4096
_MISSING = object()


def matches(fn: Any, form: CodeForm) -> bool:
    """Whether ``fn`` is a plain two-argument function whose code is exactly ``form``'s body."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ is not None:
        return False
    code = fn.__code__
    key = (id(code), id(form))
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not code or cached[1] is not form:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        cached = (code, form, same_code(code, form, fn.__doc__))
        _CACHE[key] = cached
    return cached[2] and globals_hold(fn, form)


def same_code(code: types.CodeType, form: CodeForm, doc: Optional[str]) -> bool:
    if code.co_argcount != 2 or code.co_kwonlyargcount:
        return False
    try:
        want = _compiled(form, code.co_varnames[1], doc)
    except SyntaxError:  # an argument name the template cannot take
        return False
    return (all(getattr(code, name) == getattr(want, name) for name in _COMPARED)
            # By type as well as value: 1 == 1.0 == True and 0.0 == -0.0 for ``==``, not for ``repr``.
            and repr(code.co_consts) == repr(want.co_consts)
            and code.co_flags & _KIND_FLAGS == want.co_flags & _KIND_FLAGS)


def _path_holds(module_globals: dict, head: str, attrs: Tuple[str, ...], obj: Any) -> bool:
    value = module_globals.get(head, _MISSING)
    for attr in attrs:
        value = getattr(value, attr, _MISSING)
    return value is obj


def globals_hold(fn: types.FunctionType, form: CodeForm) -> bool:
    """Whether the module globals ``fn`` reads are still the objects ``form`` names. Read again wherever a
    match is relied on: a module's globals, or a function of a module, can be rebound after the code was
    checked."""
    module_globals = fn.__globals__
    for head, attrs, obj in form.global_paths:
        if not _path_holds(module_globals, head, attrs, obj):
            return False
    return True
