"""What a tiled module's own forward is, and how a call's arguments reach the tiled call. What one shard runs
is the module's own forward: the original class's (looked up at each call), or an instance forward installed
before or after tiling (accelerate's device hooks, Liger's ``_bind_method_to_module``).
"""
from __future__ import annotations

import inspect
import types
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from .dynamo_support import bound, run_eagerly_at_top_level
from .tiling_state import TilingState, tiling_of


class TiledForward:
    """A tiled class's ``forward``: ``module.forward = f`` goes to ``__set__`` and ``f`` becomes what each shard
    runs. Reading it gives a method with the original forward's signature (``mlp(hidden_states=h)`` works)."""

    def __init__(self, signature: Optional[inspect.Signature]):
        def forward(module, *args, **kwargs):
            if torch.compiler.is_compiling():
                # Traced as one op, or as the module's own forward, where the call allows it; else the
                # eager call in a frame Dynamo skips (``compiled_route``).
                return module._tiled_compiled_forward(args, kwargs)
            return module._tiled_forward(*args, **kwargs)

        if signature is not None:
            forward.__signature__ = signature.replace(  # type: ignore[attr-defined]  # read by inspect.signature
                parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                            *signature.parameters.values()])
        self.function = forward

    def __get__(self, module, owner=None):
        # Dynamo traces the read in ``nn.Module._call_impl`` (``self.forward``): a ``functools.partial`` there
        # (``dynamo_support.bound``), eagerly the function's own binding, read here without a call.
        if module is None:
            return self.function
        if torch.compiler.is_compiling():
            return bound(self.function, module)
        return self.function.__get__(module, owner)

    def __set__(self, module, value) -> None:
        # ``module.forward = module._old_forward`` (accelerate removing its hook; unpickling a bound
        # method) puts the tiled forward itself back: that is no instance forward at all.
        own = isinstance(value, types.MethodType) and value.__self__ is module and value.__func__ is self.function
        tiling_of(module).instance_forward = None if own else value

    def __delete__(self, module) -> None:
        tiling_of(module).instance_forward = None


# Where a tiled module is called eagerly under an active ``torch.compile`` (after a graph break in an outer
# frame), Dynamo would compile ``__get__``'s own frame, and rebuild the method it returns by reading
# ``module.forward``: ``__get__`` again, without end.
run_eagerly_at_top_level(TiledForward.__get__.__code__)


def forward_signature(base: type) -> Optional[inspect.Signature]:
    try:
        signature = inspect.signature(base.forward)  # type: ignore[attr-defined]  # an nn.Module subclass
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())[1:]
    return signature.replace(parameters=params)


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module``'s class is a generated tiled class (or one derived from it, as ``fully_shard`` makes)."""
    return getattr(type(module), "_tiled_mixin", None) is not None


def base_forward(module: nn.Module) -> Callable:
    """The original class's forward function, looked up now (a forward patched on the class counts)."""
    return type(module)._tiled_base.forward  # type: ignore[attr-defined]  # set on every tiled class


def forward_function(module: nn.Module) -> Optional[Callable]:
    """The plain function the module's forward runs now, where it is a function *of this module*; None for
    anything else (a method of another module, a wrapper): no form can be proven for it."""
    installed = tiling_of(module).instance_forward
    if installed is None:
        return base_forward(module)
    if isinstance(installed, types.MethodType) and installed.__self__ is module:
        return installed.__func__
    return None


def original_forward(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """The module's own forward, without hooks: what one shard runs."""
    state = tiling_of(module)
    installed = state.instance_forward
    if installed is None:
        return base_forward(module)(module, *args)
    state.shard_depth += 1
    try:
        return installed(*args)
    finally:
        state.shard_depth -= 1


class ShardForward:
    """``original_forward`` of one module, which it holds weakly: the call plan that keeps it lives in the
    module's own state, and a strong reference would make a cycle that outlives ``del model``."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return original_forward(self.module(), *args)  # type: ignore[arg-type]  # called by the module's own call


def adopt_instance_forward(module: nn.Module, state: TilingState) -> None:
    """A forward written into the instance's __dict__ after tiling (Liger's _bind_method_to_module) is
    what each shard runs now; one that is the tiled forward itself (unpickled) is dropped by the same rule."""
    installed = module.__dict__.pop("forward", None)
    if installed is None:
        installed = state.instance_forward
        if installed is None:
            return
    descriptor = next(found for found in (vars(klass).get("forward") for klass in type(module).__mro__)
                      if isinstance(found, TiledForward))
    descriptor.__set__(module, installed)


def hidden_states_argument(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    installed = tiling_of(module).instance_forward
    signature = inspect.signature(installed) if installed is not None else type(module)._tiled_signature  # type: ignore[attr-defined]
    if signature is None:
        raise TypeError(f"{type(module).__name__}: pass the hidden states as the one positional argument")
    bound = signature.bind(*args, **kwargs)  # the TypeError untiled would raise, for a wrong call
    (name, x), *rest = bound.arguments.items()
    if rest:
        raise TypeError(
            f"{type(module).__name__}.forward was given {', '.join(n for n, _ in rest)} besides {name}: the tiled call "
            "passes the hidden states alone to each shard. Call it with the hidden states only, or untile it")
    return x
