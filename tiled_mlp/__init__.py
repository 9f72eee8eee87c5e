"""tiled-mlp: token-sharded MLPs and losses for long-sequence training, correct under DDP, FSDP2 and ZeRO."""
import importlib.util
import sys
from pathlib import Path


def _load_from_checkout() -> None:
    """A wheel installs ``tiled_core/`` and ``strategies/`` as ``tiled_mlp.core`` and ``tiled_mlp.strategies``
    (``package-dir``); run from a checkout, both load from that same checkout under those names, never another
    checkout's through an editable install."""
    here = Path(__file__).resolve().parent
    for name, folder in (("strategies", "strategies"), ("core", "tiled_core")):
        init = here.parent / folder / "__init__.py"
        if (here / name).exists() or not init.is_file() or f"{__name__}.{name}" in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(f"{__name__}.{name}", init,
                                                      submodule_search_locations=[str(init.parent)])
        assert spec is not None and spec.loader is not None, init
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(sys.modules[__name__], name, module)


_load_from_checkout()

from .core import (  # noqa: E402  (after the checkout's folders are found)
    Kernel,
    KernelCall,
    ReduceKernel,
    ShardKernel,
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
    untile,
)
from .integrations import (  # noqa: E402
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
from .strategies import (  # noqa: E402
    DDPStrategy,
    DeepSpeedZeroStrategy,
    FSDP1Strategy,
    FSDP2Strategy,
    SequenceParallelAware,
    SingleDeviceStrategy,
    Strategy,
    UnsupportedBackendError,
    available_strategies,
    get_strategy,
    register_strategy,
    unregister_strategy,
)

__version__ = "0.1.0"

__all__ = [
    "TiledMLP",
    "tile",
    "untile",
    "TiledInputs",
    "Kernel",
    "KernelCall",
    "ShardKernel",
    "ReduceKernel",
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
    "SequenceParallelAware",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "FSDP2Strategy",
    "DeepSpeedZeroStrategy",
    "FSDP1Strategy",
    "UnsupportedBackendError",
    "register_strategy",
    "unregister_strategy",
    "available_strategies",
    "get_strategy",
]
