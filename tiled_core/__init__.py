"""Backend-neutral tiled MLP and tiled loss. Imports torch only; backends are reached through the ``Strategy``
interface, and what a model library knows is registered from outside (``tiled_mlp.integrations``).
"""
# The folder is installed as tiled_mlp.core; imported by its repository name (from the repository's root) it would
# be a second copy of every module, with registries of its own.
if __name__ != "tiled_mlp.core":
    raise ImportError(f"{__name__} is installed as tiled_mlp.core: import tiled_mlp.core (or tiled_mlp)")

from . import builtin_kernels  # noqa: F401  # registers the built-in kernels
from .class_swap import install_tiling, prepare_tiling, untile
from .fast_path import FastPathRefused, fast_path_problem
from .gated_forms import GatedForm, register_gated_mlp, unregister_gated_mlp
from .kernel_registry import Kernel, KernelCall, available_kernels, register_kernel, unregister_kernel
from .kernels import ReduceKernel, ShardKernel
from .module import TiledMLP, tile
from .shard_plan import ShardPlan, make_shard_plan
from .sharded_autograd import ShardedMapFunction, ShardedReduceFunction, ShardedRun, sharded_apply, sharded_reduce
from .tiled_call import TiledInputs, tiled_call
from .tiled_loss import TiledCrossEntropy, tiled_cross_entropy
from .tiling_state import TilingState

# Tiling in place in two steps (every check, then the change), for callers that tile many blocks at
# once and roll back together (``apply_tiled_mlp``): ``prepare_tiling``, ``install_tiling``, ``TilingState``.
__all__ = ["TiledMLP", "tile", "untile", "TiledInputs", "prepare_tiling", "install_tiling", "TilingState",
           "FastPathRefused", "fast_path_problem", "GatedForm", "register_gated_mlp", "unregister_gated_mlp",
           "Kernel", "KernelCall", "ShardKernel", "ReduceKernel", "register_kernel", "unregister_kernel", "available_kernels", "tiled_call",
           "ShardPlan", "make_shard_plan", "ShardedMapFunction", "ShardedRun", "sharded_apply",
           "ShardedReduceFunction", "sharded_reduce", "tiled_cross_entropy", "TiledCrossEntropy"]
