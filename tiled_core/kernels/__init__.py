"""Per-shard kernels: what one token shard computes in forward and in backward (``base.py``: the base
classes; the built-in kernels beside it). They share the sharding, RNG replay and gradient delivery of
``sharded_autograd``."""
from .base import ReduceKernel, ShardKernel

__all__ = ["ShardKernel", "ReduceKernel"]
