"""Per-shard kernels: what one token shard computes in forward and in backward.

Both kernels share the sharding, RNG replay and gradient delivery of ``sharded_autograd``; they differ
only in how a shard's forward and backward are computed.
"""
from .base import ShardKernel
from .gated import GatedShardKernel
from .generic import GenericShardKernel

__all__ = ["ShardKernel", "GenericShardKernel", "GatedShardKernel"]
