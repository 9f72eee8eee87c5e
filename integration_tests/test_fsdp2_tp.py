"""FSDP2 x tensor parallelism on a (dp 2, tp 2) mesh, four gloo processes, as torchtitan builds it: a tiny
Hugging Face Llama with torchtitan's TP plan, then ``apply_tiled_mlp(model, loss=True, norms=True)``, then
``fully_shard`` over dp (``fsdp2_tp_cases.py``). Against one process on the whole model and batch, float64:
the loss and every full gradient at each of two SGD steps, and the parameters after them, within ``BOUND``;
the MLPs take the fast path on their local weights, or, asked for, the generic path (their own forward and its
tensor-parallel collectives once per shard).
"""
from __future__ import annotations

import pytest

from .comparison import BOUND
from .fsdp2_tp_cases import DP, TP, run_fsdp2_tp
from .spawn import run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mlp_path", ["fast", "generic"])
def test_tiled_llama_under_fsdp2_times_tp_trains_as_one_process(tmp_path, mlp_path):
    results = run_distributed(run_fsdp2_tp, DP * TP, tmp_path, mlp_path, timeout=120)
    for rank, errors in enumerate(results):
        assert errors.pop("tiled_mlps") == 2 and errors.pop("tiled_loss") == 1, f"rank {rank}: MLPs and loss tiled"
        paths = {name: errors.pop(name) for name in list(errors) if name.startswith("mlp_path")}
        assert all(paths.values()), f"rank {rank}: an MLP did not take the {mlp_path} path under TP: {paths}"
        bad = {name: error for name, error in errors.items() if not error <= BOUND}
        assert not bad, f"rank {rank}: relative errors above {BOUND}: {bad}"
