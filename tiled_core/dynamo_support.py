"""Deciding something once where Dynamo traces a call, from the objects the call sees: the decision runs at
trace time through ``assume_constant_result`` and its answer is a constant of the graph. torch 2.12 and later
pass objects and guard on their identity; 2.9 to 2.11 pass each object as its ``id`` and the decision turns it
back (docs/compile.md). Nothing here imports Dynamo (``tests/test_light_import.py`` checks the marks).
"""
from __future__ import annotations

import ctypes
import functools
import operator
import types
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch

T = TypeVar("T")

# The releases whose Dynamo traces a tiled model as one graph (checked on 2.9 to 2.15); before, every tiled call
# runs eagerly behind a graph break and says why (``tests/test_compile_eager_fallback.py`` forces it).
TRACES_TILED_CALLS: bool = torch.__version__ >= "2.9"
REASON = f"torch {torch.__version__}'s Dynamo cannot trace a tiled call as one op (torch >= 2.9 can)"

# A pre-release (2.12.0a0) compares below its release and takes the older path, which that release also runs.
PASSES_OBJECTS: bool = torch.__version__ >= "2.12"

# What ``assume_constant_result`` passes as itself on every release; any other object goes by its id below 2.12.
_AS_IS = (type(None), bool, int, float, str, tuple, torch.dtype, torch.device, type, types.FunctionType)


def _marked_constant(function: Callable[..., T]) -> Callable[..., T]:
    """``torch._dynamo.assume_constant_result(function)``: the mark it sets (torch 2.13), without importing Dynamo."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


# ``torch.compiler.disable`` made at the first call (importing Dynamo then, not at import time).
disable: Callable[..., Any] = getattr(torch, "_disable_dynamo", torch.compiler.disable)  # private; torch.optim uses it


def _object_at(address: int) -> Any:
    return ctypes.cast(address, ctypes.py_object).value


def _specialized(value: Any) -> Any:
    """``value`` with each int in it made a constant (``operator.index`` specializes a symbolic one, guarded: a new
    size traces again): ``assume_constant_result`` takes no symbolic int."""
    if type(value) is int:
        return operator.index(value)
    if type(value) in (tuple, torch.Size):
        return type(value)([operator.index(v) if type(v) is int else v for v in value])
    return value


def decided_where_traced(decide: Callable[..., T]) -> Callable[..., T]:
    """``decide(*args)`` as a constant of the graph, traced again when an object among ``args`` is another one
    or a constant among them changes; outside a trace, a plain call."""

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
    """``function`` bound to ``obj``: a method eagerly; where Dynamo traces, a ``functools.partial`` (every release
    traces it, while ``__get__`` breaks the graph before 2.12 and ``types.MethodType`` on every release)."""
    if torch.compiler.is_compiling():
        return functools.partial(function, obj)
    return function.__get__(obj, type(obj))


def run_eagerly_at_top_level(code: types.CodeType) -> None:
    """Frames of ``code`` run eagerly where Dynamo meets them at the top level (there ``is_compiling()`` is true in
    eager code), and are still inlined where it traces their caller: ``eval_frame.skip_code``'s C function, which
    needs no import of Dynamo (private: where it is missing, nothing is skipped)."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    strategy, action = getattr(frames, "_FrameExecStrategy", None), getattr(frames, "_FrameAction", None)
    if strategy is not None and action is not None:
        frames.set_code_exec_strategy(code, strategy(action.SKIP, action.DEFAULT))  # type: ignore[union-attr]


# ``bound`` read eagerly under an active compile gives the method, not the partial.
run_eagerly_at_top_level(bound.__code__)
