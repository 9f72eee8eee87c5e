"""tiled-mlp: token-sharded MLPs for long-sequence training, correct under DDP, FSDP2 and ZeRO."""
from .strategies import (
    Strategy,
    UnsupportedBackendError,
    available_strategies,
    get_strategy,
    register_strategy,
    unregister_strategy,
)
from .tiled_core import TiledMLP

__version__ = "0.1.0"

__all__ = [
    "TiledMLP",
    "Strategy",
    "UnsupportedBackendError",
    "register_strategy",
    "unregister_strategy",
    "available_strategies",
    "get_strategy",
]
