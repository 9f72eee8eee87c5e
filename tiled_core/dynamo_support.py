"""Deciding something once where Dynamo traces a call, from the objects the call sees.

A decision runs at trace time through ``assume_constant_result`` and its answer is a constant of the graph,
kept while the objects are the same. torch 2.12 and later pass objects and guard on their identity; 2.9 to
2.11 pass each object as its ``id`` and the decision turns it back (docs/compile.md, "On older torch", says
what differs there). Nothing here imports Dynamo: its marks are made the way its decorators make them, or at
the first call, and ``tests/test_light_import.py`` checks each against Dynamo's own.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import types
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")

# The releases whose Dynamo traces a tiled model as one graph (checked on 2.9, 2.10, 2.11, 2.13 and 2.15).
# Before 2.9 it cannot: 2.8 has no ``vars()`` of a module, and 2.6 stops with an internal error where a
# decision returns a route. There every tiled call (MLP, norm, loss) runs eagerly behind a graph break, exact,
# and says why (``REASON``; ``tests/test_compile_eager_fallback.py`` forces it on any torch).
TRACES_TILED_CALLS: bool = torch.__version__ >= "2.9"
REASON = f"torch {torch.__version__}'s Dynamo cannot trace a tiled call as one op (torch >= 2.9 can)"

# A pre-release (2.12.0a0) compares below its release and takes the older path, which that release also runs.
PASSES_OBJECTS: bool = torch.__version__ >= "2.12"

# What ``assume_constant_result`` converts itself on every release: the constants, and the functions and
# classes it passes as themselves. Any other object goes by its id below 2.12.
_AS_IS = (type(None), bool, int, float, str, tuple, torch.dtype, torch.device, type, types.FunctionType)


def _marked_constant(function: Callable[..., T]) -> Callable[..., T]:
    """``torch._dynamo.assume_constant_result(function)``, which marks the function with this attribute and
    returns it (torch 2.13; Dynamo reads the mark where it traces a call, ``variables/functions.py``)."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


# ``torch.compiler.disable`` made at the first call (importing Dynamo then, not at import time): torch's own
# lazy form, whose wrapper Dynamo skips as torch's code (a graph break, then the disabled function).
disable: Callable[..., Any] = getattr(torch, "_disable_dynamo", torch.compiler.disable)  # private; torch.optim uses it


def _object_at(address: int) -> Any:
    return ctypes.cast(address, ctypes.py_object).value


def _specialized(value: Any) -> Any:
    """``value`` with each int in it (it or a tuple's item) made a constant: ``assume_constant_result`` takes no
    symbolic int. ``operator.index`` specializes one, guarded, so each new size traces the call again, as
    ``dynamic=False`` does (docs/compile.md). A size marked with ``mark_dynamic`` must not be given here."""
    if type(value) is int:
        return operator.index(value)
    if type(value) in (tuple, torch.Size):
        return type(value)([operator.index(v) if type(v) is int else v for v in value])
    return value


def decided_where_traced(decide: Callable[..., T]) -> Callable[..., T]:
    """``decide(*args)``, run by Dynamo where it traces the call and kept as a constant of the graph, traced
    again when an object among ``args`` is another one or a constant among them changes (tuples of
    constants only; a symbolic size among them is specialized: ``_specialized``). Positional arguments
    only. Outside a trace it is a plain call."""

    @_marked_constant
    def by_object(*args: Any) -> T:
        return decide(*args)

    @_marked_constant
    def by_identity(classes: Tuple[Optional[type], ...], *args: Any) -> T:
        objects = [a if cls is None else _object_at(a) for cls, a in zip(classes, args, strict=True)]
        for cls, obj in zip(classes, objects, strict=True):
            if cls is not None and type(obj) is not cls:
                raise RuntimeError(f"{decide.__name__}: Dynamo gave a {type(obj).__name__} for an argument that is a "
                                   f"{cls.__name__} where the call was traced; it cannot be decided where traced")
        return decide(*objects)

    @functools.wraps(decide)
    def traced(*args: Any) -> T:
        if not torch.compiler.is_compiling():
            return decide(*args)
        if PASSES_OBJECTS:
            return by_object(*[_specialized(a) for a in args])
        classes = tuple([None if isinstance(a, _AS_IS) else type(a) for a in args])
        passed: List[Any] = [_specialized(args[k]) if classes[k] is None else id(args[k]) for k in range(len(args))]
        return by_identity(classes, *passed)

    return traced


def bound(function: Callable, obj: Any) -> Callable:
    """``function`` bound to ``obj``: eagerly its own binding (a method, as every reader expects); where Dynamo
    traces, a ``functools.partial``, which every release traces, while ``function.__get__`` is a graph
    break before torch 2.12 and a method built by hand (``types.MethodType``) is one on every release."""
    if torch.compiler.is_compiling():
        return functools.partial(function, obj)
    return function.__get__(obj, type(obj))


def run_eagerly_at_top_level(code: types.CodeType) -> None:
    """Dynamo compiles every frame it meets while a compile is active, even one called from a frame it skips
    (``torch.compiler.disable(recursive=False)``, code after a graph break); there ``is_compiling()`` is true
    in eager code. Frames of ``code`` are skipped at the top level, and still inlined where Dynamo traces
    their caller: ``torch._dynamo.eval_frame.skip_code``, through the C function it calls, which needs no
    import of Dynamo (private: where it is missing, nothing is skipped)."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy, action = getattr(frames, "_FrameExecStrategy", None), getattr(frames, "_FrameAction", None)
    if strategy is not None and action is not None:
        frames.set_code_exec_strategy(code, strategy(action.SKIP, action.DEFAULT))  # type: ignore[union-attr]


# ``bound`` read eagerly under an active compile gives the method, not the partial.
run_eagerly_at_top_level(bound.__code__)
