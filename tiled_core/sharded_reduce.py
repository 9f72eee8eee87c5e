"""The reduction shape lives in ``sharded_autograd`` (one mechanism for both shapes); these names stay
importable from here for the call path's imports."""
from .sharded_autograd import LOSS_DOUBLE_BACKWARD_ERROR, SECOND_BACKWARD_ERROR, ShardedReduceFunction, sharded_reduce

__all__ = ["LOSS_DOUBLE_BACKWARD_ERROR", "SECOND_BACKWARD_ERROR", "ShardedReduceFunction", "sharded_reduce"]
