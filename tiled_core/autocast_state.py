"""The forward's autocast state lives in ``sharded_autograd`` (replayed around its recompute); these names
stay importable from here for the call path's imports."""
from .sharded_autograd import AutocastState, autocast_enabled

__all__ = ["AutocastState", "autocast_enabled"]
