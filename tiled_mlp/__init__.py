"""tiled-mlp: token-sharded MLPs and losses for long-sequence training, correct under DDP, FSDP2 and ZeRO."""
from strategies import (
    Strategy,
    UnsupportedBackendError,
    available_strategies,
    get_strategy,
    register_strategy,
    unregister_strategy,
)
from tiled_core import (
    Kernel,
    KernelCall,
    TiledCrossEntropy,
    TiledInputs,
    TiledMLP,
    available_kernels,
    register_gated_mlp,
    register_kernel,
    tile,
    tiled_cross_entropy,
    unregister_gated_mlp,
    unregister_kernel,
)

from .integrations import (
    TilingReport,
    add_tiled_mlp_args,
    apply_checkpoint_offload,
    apply_long_context,
    apply_sequence_parallel,
    apply_tiled_loss,
    apply_tiled_mlp,
    enable_tiled_mlp,
    remove_tiled_loss,
    remove_tiled_mlp,
)

__version__ = "0.1.0"

__all__ = [
    "TiledMLP",
    "tile",
    "TiledInputs",
    "Kernel",
    "KernelCall",
    "register_kernel",
    "unregister_kernel",
    "available_kernels",
    "tiled_cross_entropy",
    "TiledCrossEntropy",
    "register_gated_mlp",
    "unregister_gated_mlp",
    "apply_tiled_mlp",
    "remove_tiled_mlp",
    "apply_long_context",
    "apply_checkpoint_offload",
    "apply_sequence_parallel",
    "apply_tiled_loss",
    "remove_tiled_loss",
    "TilingReport",
    "enable_tiled_mlp",
    "add_tiled_mlp_args",
    "Strategy",
    "UnsupportedBackendError",
    "register_strategy",
    "unregister_strategy",
    "available_strategies",
    "get_strategy",
]
