"""Backend-neutral tiled MLP: shard plan, sharded autograd, per-shard kernels, the TiledMLP module.

Imports torch only; backends are reached through the ``Strategy`` interface. The one optional import
is Liger-Kernel's Triton activation (``activations.py``), a kernel library, not a backend: imported
lazily, on CUDA, only when it is installed.
"""
from .gated_forms import GatedForm, register_gated_mlp, unregister_gated_mlp
from .module import TiledMLP, untile
from .shard_plan import ShardPlan, make_shard_plan
from .sharded_autograd import ShardedMLPFunction, ShardedRun, sharded_apply

__all__ = ["TiledMLP", "untile", "GatedForm", "register_gated_mlp", "unregister_gated_mlp", "ShardPlan", "make_shard_plan", "ShardedMLPFunction", "ShardedRun", "sharded_apply"]
