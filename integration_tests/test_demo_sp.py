"""``tiled-mlp demo --nproc 2 --sp 2``: the whole stack (tiled MLP, tiled loss, checkpoint offload, Ulysses
SP over 2 gloo processes launched by torchrun) trains to the same losses as the plain model in one
process. The demo prints the comparison; this runs it as a user would and reads the verdict."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.mark.timeout(240)
def test_demo_with_sequence_parallelism_matches_one_process():
    command = [sys.executable, "-m", "tiled_mlp.cli.main", "demo", "--nproc", "2", "--sp", "2", "--seq", "512",
               "--hidden", "64", "--intermediate", "256", "--steps", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"largest loss difference: (\S+); host memory held by the offload \(rank 0, at most\): (\S+) MiB",
                      done.stdout)
    assert found, done.stdout
    # float32, 3 SGD steps: the SP run sums its loss in another order than one process does.
    assert float(found.group(1).rstrip(";")) < 1e-5
    assert float(found.group(2)) > 0
    assert done.stdout.count("| ") >= 3 * 4
