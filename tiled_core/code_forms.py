"""Is a function exactly a given body of code? Decided by its bytecode, not by running it.

The gated fast kernel stands in for a module's forward. A numeric probe of that forward cannot prove
it may: a probe was fooled by a clamp that random inputs never reach, a branch on
``torch.is_grad_enabled()``, a factor within bf16's tolerance of 1, and an in-place edit of the input
that the probe's own input shared. What a function *is* can be decided instead: its code object.

A ``CodeForm`` is a method body written as source. ``matches(fn, form)`` compiles that body, on the
running interpreter, into a method with ``fn``'s own argument name and docstring, and compares the
code objects field by field (instructions, constants, names, local names, argument counts, flags).
Equal code with the same globals runs the same operations on the same attributes of ``self``: the
installed library's forward is checked as it is, whatever its version, and a patched, wrapped or
edited forward is a different function with other code. What the code reads through ``self``
(submodules, factors) is checked by the caller (``gated_forms``).
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

_COMPARED = ("co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_posonlyargcount",
             "co_kwonlyargcount", "co_freevars", "co_cellvars")
# The flags of what kind of code it is (optimized, generator, varargs, ...); the ``__future__`` bits above
# them say how the module was compiled (``from __future__ import annotations``), not what the body does.
_KIND_FLAGS = 0xFFFF


@dataclass(frozen=True)
class CodeForm:
    """A method body, ``{x}`` standing for its one argument besides ``self``; ``globals`` names each
    module-level name the body loads and the object it must be in the function's module."""

    body: str
    globals: Mapping[str, Any] = field(default_factory=dict)


def _compiled(form: CodeForm, arg: str, doc: Optional[str]) -> types.CodeType:
    # Each global is declared as an import, as the libraries bind them: CPython compiles a call on an
    # imported name (``F.silu(...)``) with other instructions than a call on any other global.
    lines = [f"import {name}" for name in form.globals]
    lines.append(f"def forward(self, {arg}):")
    if doc is not None:
        lines.append(f"    {doc!r}")
    lines += [f"    {line}" for line in form.body.format(x=arg).splitlines()]
    module = compile("\n".join(lines), "<tiled_mlp form>", "exec", dont_inherit=True)
    (code,) = [c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == "forward"]
    return code


_CACHE: Dict[Tuple[int, int], Tuple[Any, CodeForm, bool]] = {}


def matches(fn: Any, form: CodeForm) -> bool:
    """Whether ``fn`` is a plain two-argument function whose code is exactly ``form``'s body."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ is not None:
        return False
    key = (id(fn), id(form))
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is fn and cached[1] is form:
        return cached[2] and _globals_hold(fn, form)
    code = fn.__code__
    found = False
    if code.co_argcount == 2 and not code.co_kwonlyargcount:
        try:
            want = _compiled(form, code.co_varnames[1], fn.__doc__)
        except SyntaxError:  # an argument name the template cannot take
            want = None
        found = (want is not None and all(getattr(code, name) == getattr(want, name) for name in _COMPARED)
                 and code.co_flags & _KIND_FLAGS == want.co_flags & _KIND_FLAGS)
    # The function and the form are kept alive by the cache, so their ids cannot be reused.
    _CACHE[key] = (fn, form, found)
    return found and _globals_hold(fn, form)


def _globals_hold(fn: types.FunctionType, form: CodeForm) -> bool:
    # Read at every call: a module's globals can be rebound after the code was checked.
    return all(fn.__globals__.get(name) is obj for name, obj in form.globals.items())
