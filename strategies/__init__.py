"""Pluggable parallel backends for TiledMLP (strategy instances, optional capabilities as mixins), a
registry of classes with their constructor arguments, and a resolver."""
# The folder is installed as tiled_mlp.strategies; imported by its repository name (from the repository's root) it would
# be a second copy of every module, with registries of its own.
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

for _builtin, _description in (
    (SingleDeviceStrategy, "one device: whole parameters, gradients through autograd (the fallback)"),
    (DDPStrategy, "DistributedDataParallel: its reducer all-reduces each gradient, delivered once"),
    (FSDP1Strategy, "FullyShardedDataParallel (FSDP1): refused, with the way to FSDP2"),
    (FSDP2Strategy, "fully_shard (FSDP2): its hooks unshard around the call and reduce-scatter the gradients"),
    (DeepSpeedZeroStrategy, "DeepSpeed ZeRO stages 1-3: ZeRO-3's parameters gathered once around the call"),
    (DeepSpeedAutoTPStrategy, "a DeepSpeed AutoTP layer whose output stays split: refused"),
    (TensorParallelHeadStrategy, "lm_head parallelized with ColwiseParallel: the vocabulary-parallel loss"),
):
    register_strategy(_builtin, description=_description)

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
