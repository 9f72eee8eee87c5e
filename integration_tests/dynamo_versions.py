"""The marker for tests of what a traced call becomes: the ops, one graph, guards. On torch < 2.12 every tiled
call runs eagerly under torch.compile (``tiled_mlp.core.dynamo_support``); ``tests/test_compile_old_dynamo.py``
proves that path on any torch."""
import pytest

from tiled_mlp.core.dynamo_support import TRACES_OBJECT_ARGUMENTS

traced_as_ops = pytest.mark.skipif(not TRACES_OBJECT_ARGUMENTS,
                                   reason="torch < 2.12: tiled calls run eagerly under torch.compile (dynamo_support)")
