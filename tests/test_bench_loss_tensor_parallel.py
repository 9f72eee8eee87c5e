"""``tiled-mlp bench-loss --tensor-parallel``: the vocabulary-parallel loss's per-rank peak, modelled with
fake tensors on a fake process group, against x + dx + the rank's W and dW + one shard."""
import contextlib
import io
import json

import pytest

from tiled_mlp.cli.main import main

pytestmark = pytest.mark.timeout(60)


def test_vocab_parallel_peak_stays_within_the_rank_floor_plus_one_shard():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench-loss", "--tensor-parallel", "4", "--memory-size", "4096,512,16000", "--json"]) == 0
    result = json.loads(out.getvalue())
    assert result["rows_per_rank"] == 4000
    # Everything alive is counted: the peak holds at least x, dx and the rank's W and dW.
    assert result["floor_bytes"] <= result["peak_bytes"] <= 1.1 * result["reference_bytes"], result
    assert result["met"]
