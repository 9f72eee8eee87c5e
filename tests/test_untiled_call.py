"""When a call may run the plain module instead of the tiled loop, and what it does when it may not.

"auto" runs a call untiled when it is too short for tiling to pay, and any call with no tokens. A
strategy whose backend gathers inside the tiled call (ZeRO-3) forbids that, because a rank running
untiled beside one that tiles would issue other collectives; then the call tiles in one shard (or one
empty shard) and must still be exact. The ZeRO-3 multi-process case is in integration_tests.
"""
import pytest
from reference import GatedMLP, PlainMLP, assert_runs_close, fresh_inputs, seeded, tiled_run, untiled_run

from tiled_mlp.strategies import SingleDeviceStrategy

pytestmark = pytest.mark.timeout(60)


class TiledOnly(SingleDeviceStrategy):
    """A backend that, like ZeRO-3, needs every call on the tiled path."""

    name = "test_tiled_only"

    def allows_untiled_call(self, module):
        return False


@pytest.mark.parametrize("builder, path", [(GatedMLP, "fast"), (PlainMLP, "generic"), (GatedMLP, "generic")])
@pytest.mark.parametrize("tokens", [0, 1])  # 2 tokens in all: too short for "auto" to tile
@pytest.mark.parametrize("strategy", ["single_device", TiledOnly()], ids=["untiled_allowed", "tiled_only"])
def test_short_and_empty_calls_are_exact_on_either_path(builder, path, tokens, strategy):
    module = seeded(builder, 0, 8, 24)
    x, dy = fresh_inputs((2, tokens, 8), 8)
    want = untiled_run(module, x, dy)
    have, tiled = tiled_run(module, x, dy, num_shards="auto", path=path, strategy=strategy)
    assert_runs_close(want, have, context=f"{builder.__name__} {tokens} tokens")
    if isinstance(strategy, TiledOnly):
        assert (tiled.tiling.last_path, tiled.tiling.last_num_shards) == (path, 1)
    else:
        assert tiled.tiling.last_path == "untiled"
