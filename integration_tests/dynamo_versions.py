"""The marker for tests of what a traced call becomes: the ops, one graph, guards. Before torch 2.9 every tiled
call runs eagerly under torch.compile (``tiled_mlp.core.dynamo_support``); ``tests/test_compile_eager_fallback.py``
proves that path on any torch."""
import pytest

from tiled_mlp.core.dynamo_support import TRACES_TILED_CALLS

traced_as_ops = pytest.mark.skipif(not TRACES_TILED_CALLS,
                                   reason="torch < 2.9: tiled calls run eagerly under torch.compile (dynamo_support)")
