"""Backend-neutral tiled MLP: shard plan, sharded autograd, per-shard kernels, the TiledMLP module.

Imports torch only; backends are reached through the ``Strategy`` interface.
"""
from .module import TiledMLP
from .shard_plan import ShardPlan, make_shard_plan
from .sharded_autograd import ShardedMLPFunction, ShardedRun, sharded_apply

__all__ = ["TiledMLP", "ShardPlan", "make_shard_plan", "ShardedMLPFunction", "ShardedRun", "sharded_apply"]
