"""Pluggable parallel backends for TiledMLP: strategy classes, their registry, and the resolver."""
# Imported by its repository name (from the repository's root) it would be a second copy with its own registry.
if __name__ != "tiled_mlp.strategies":
    raise ImportError(f"{__name__} is installed as tiled_mlp.strategies: import tiled_mlp.strategies (or tiled_mlp)")

from .base import (
    SequenceParallelAware,
    Strategy,
    UnsupportedBackendError,
    WaitsForEveryParameter,
    claims_need_process_group,
)
from .ddp import DDPStrategy
from .deepspeed_autotp import DeepSpeedAutoTPStrategy
from .deepspeed_zero import DeepSpeedZeroStrategy
from .fsdp1 import FSDP1Strategy
from .fsdp2 import FSDP2Strategy
from .registry import (
    available_strategies,
    get_strategy,
    get_strategy_class,
    register_strategy,
    unregister_strategy,
)
from .resolver import resolve_strategy, strategy_from_arg
from .single_device import SingleDeviceStrategy
from .tensor_parallel_head import TensorParallelHeadStrategy

for _builtin in (SingleDeviceStrategy, DDPStrategy, FSDP1Strategy, FSDP2Strategy, DeepSpeedZeroStrategy,
                 DeepSpeedAutoTPStrategy, TensorParallelHeadStrategy):
    register_strategy(_builtin)

__all__ = [
    "Strategy",
    "UnsupportedBackendError",
    "WaitsForEveryParameter",
    "SequenceParallelAware",
    "claims_need_process_group",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "FSDP1Strategy",
    "FSDP2Strategy",
    "DeepSpeedZeroStrategy",
    "DeepSpeedAutoTPStrategy",
    "TensorParallelHeadStrategy",
    "register_strategy",
    "unregister_strategy",
    "available_strategies",
    "get_strategy",
    "get_strategy_class",
    "resolve_strategy",
    "strategy_from_arg",
]
