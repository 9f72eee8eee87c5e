"""``TiledMLP``: tiles any token-wise MLP *in place* (a class swap, ``class_swap.py``), so that parameter names,
``state_dict``, adapters and checkpoints stay those of the untiled module (docs/guarantees.md, "Drop-in").
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import nn

from tiled_mlp.strategies.resolver import StrategyArg

from .class_swap import install_tiling, prepare_tiling, rebuild, record_own_names
from .compiled_route import compiled_call
from .shard_plan import NumShards
from .tiled_call import TiledInputs, default_tiled_inputs, module_forward
from .tiling_state import STATE_ATTR, TilingState


class TiledMLP(nn.Module):
    """Tiles ``mlp`` (``[..., tokens, hidden] -> [..., tokens, out]``, token-wise) in place.

    ``TiledMLP(mlp, ...)`` returns ``mlp`` itself, an instance of ``TiledMLP`` as well.

    Args:
        mlp: the module to tile.
        strategy: "auto" (resolved from the runtime at every forward), a registered name, or a
            ``Strategy`` instance.
        num_shards: an int >= 1, or "auto".
        path: "auto" (the registered kernels in priority order: the gated fast kernel where it provably
            applies, else generic), or a registered kernel's name ("fast", "generic", or one added with
            ``register_kernel``): only that kernel is asked.
        grad_accum_dtype: dtype of the per-parameter gradient sums (default: the parameter's dtype);
            ``torch.float32`` for low-precision parameters.
        use_fused_kernel: use a registered fused activation kernel (tiled_mlp registers Liger-Kernel's
            Triton one on CUDA when it is installed) where one applies.

    Hooks on the tiled module fire once per call, as untiled; hooks on its submodules once per shard
    (docs/guarantees.md).
    """

    # Annotation only (no class attribute, so it hides nothing of the tiled module's): the tiling state,
    # set in the instance's __dict__ when it is tiled.
    tiling: TilingState
    _tiled_base: Optional[type] = None  # set on the generated classes: the module's original class
    _tiled_mixin: type  # set on the generated classes: TiledMLP or a subclass of it
    _tiled_signature: Optional[inspect.Signature] = None  # set on the generated classes: the original forward's
    #: Why the gated fast kernel can never stand in for this kind of module's forward ("": it may).
    tiled_no_fast_path = ""

    def __new__(cls, mlp: Optional[nn.Module] = None, strategy: StrategyArg = "auto", num_shards: NumShards = "auto",
                path: str = "auto", grad_accum_dtype: Optional[torch.dtype] = None, use_fused_kernel: bool = True):
        if cls._tiled_base is not None:
            # A generated class instantiated directly (``type(tiled)(config)``): a new module of the
            # original class, tiled with the defaults (``__init__`` builds it).
            return object.__new__(cls)
        fixed = prepare_tiling(cls, mlp, strategy, num_shards, path, grad_accum_dtype)
        assert mlp is not None  # prepare_tiling refused anything but a module
        return install_tiling(cls, mlp, TilingState(num_shards, path, grad_accum_dtype, use_fused_kernel, fixed))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_tiled_base" not in vars(cls):  # a tiling mixin (TiledNorm, a third party's), not a generated class
            record_own_names(cls)

    def __init__(self, *args, **kwargs):
        if STATE_ATTR in self.__dict__:
            return  # tiled in place by __new__: the module was built long ago
        base: Any = type(self)._tiled_base  # set on every generated class
        base.__init__(self, *args, **kwargs)
        self.__dict__[STATE_ATTR] = TilingState()

    def __reduce_ex__(self, protocol):
        # copy, deepcopy and pickle. The copy tiles on its own: its own ``TilingState`` (the configuration
        # and the last report copied, no cached plan), where ``copy.copy`` would otherwise share the original's.
        # Set in a copy of what the class's ``__getstate__`` returns: a user's MLP class may return its live
        # ``__dict__``, or leave the tiling out.
        cls = type(self)
        state = dict(self.__getstate__())
        state[STATE_ATTR] = self.__dict__[STATE_ATTR].copied()
        return rebuild, (cls._tiled_mixin, cls._tiled_base), state

    def extra_repr(self) -> str:
        state: TilingState = self.tiling
        strategy = state.fixed_strategy.name if state.fixed_strategy else "auto"
        mine = f"tiled: num_shards={state.num_shards!r}, path={state.path!r}, strategy={strategy!r}"
        base = super().extra_repr()
        return f"{base}, {mine}" if base else mine

    # A subclass for a module with other token-wise inputs overrides it (``TiledInputs.token_inputs``).
    tiled_inputs: Callable[..., TiledInputs] = default_tiled_inputs

    _tiled_forward = module_forward

    def _tiled_compiled_forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """What ``TiledForward`` calls while Dynamo traces (``compiled_route``)."""
        default_inputs = type(self).tiled_inputs is TiledMLP.tiled_inputs
        return compiled_call(self, default_inputs, args, kwargs)


record_own_names(TiledMLP)


def tile(module: nn.Module, *, strategy: StrategyArg = "auto", num_shards: NumShards = "auto", path: str = "auto",
         grad_accum_dtype: Optional[torch.dtype] = None, use_fused_kernel: bool = True) -> nn.Module:
    """Tile ``module`` in place and return it (``TiledMLP(module, ...)`` as a verb, as ``fully_shard``)."""
    return TiledMLP(module, strategy, num_shards, path, grad_accum_dtype, use_fused_kernel)
