"""The tiled kernels as ``torch.library`` custom ops, for ``torch.compile``: Dynamo traces a tiled call
as one node of the graph (no graph break), whose autograd, fake (shape) kernel and backward are
registered here. The shards run eagerly inside the node, through the same kernels and shard loops as
the sharded autograd Function (``sharded_autograd``). Which calls take an op is decided where the call is
traced (``compiled_route``)."""
from .map_ops import gated_mlp, rms_norm

__all__ = ["gated_mlp", "rms_norm"]
