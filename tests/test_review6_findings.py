"""Review findings on the session that made a deleted model freed by reference counts (weak references from
call plans, the tiled loss, checkpoint offload and tiling reports; the fast plan watching the plain values its
decision read).

Each test states what the library does, measured against the same model untiled (float64 where the numbers
matter); each was red before its fix (the review's measurements in the comments), or on an earlier commit.
"""
from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from reference import GatedMLP, falcon_h1_mlp_and_tiled_copy
from torch._dynamo.testing import CompileCounterWithBackend

from integration_tests.frameworks import need
from integration_tests.tiny_models import tiny_model, token_ids
from tiled_mlp import TiledMLP, apply_tiled_mlp

pytestmark = pytest.mark.timeout(60)


def test_a_named_scale_rebound_to_an_equal_tensor_after_the_first_call_gets_its_gradient():
    # Before: the watch compared by ==, so the plan held and the scale's gradient was None (untiled 0.0156).
    reference, module = falcon_h1_mlp_and_tiled_copy()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    module(x)
    value = reference.down_multiplier
    reference.down_multiplier = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    module.down_multiplier = torch.tensor(value, dtype=torch.float64, requires_grad=True)
    reference(x).sum().backward()
    module(x).sum().backward()
    assert module.down_multiplier.grad is not None
    torch.testing.assert_close(module.down_multiplier.grad, reference.down_multiplier.grad, rtol=0, atol=1e-12)


def test_a_tiling_report_pickles_with_its_model():
    # Before: TypeError, cannot pickle a weak reference (the report pickled at 357d7e0).
    need("transformers")
    model = tiny_model("llama")
    report = apply_tiled_mlp(model, num_shards=2)
    ids = token_ids()
    labels = ids.clone()
    model(input_ids=ids, labels=labels)
    loaded_model, loaded_report = pickle.loads(pickle.dumps((model, report)))
    assert [block.tiled for block in loaded_report.blocks] == [loaded_model.model.layers[i].mlp for i in range(2)]
    assert loaded_report.paths() == report.paths()


_FIRST_CALL_COMPILED = """
import torch
from integration_tests.tiny_models import VOCAB, tiny_model
from tiled_mlp import apply_tiled_mlp

ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
want = tiny_model("gemma")(input_ids=ids, labels=ids).loss
model = tiny_model("gemma")
apply_tiled_mlp(model, num_shards=2)
got = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
print("LOSS_ERROR", abs(got.item() - want.item()))
"""


def test_a_tiled_gemma_compiled_before_any_eager_tiled_call_equals_the_untiled_model():
    # Before: SpeculationLogDivergence (the registration counter was installed during the first trace).
    need("transformers")
    # A fresh process: the hook is installed once per process, by the first tiled call.
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL_COMPILED], cwd=root, capture_output=True, text=True,
                          timeout=55, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split("LOSS_ERROR")[1]) < 1e-10


@pytest.mark.usefixtures("fresh_dynamo")
def test_an_untiled_compiled_model_is_not_recompiled_at_each_call_once_something_was_tiled():
    # Before: the registration count was a guard: frames 2, 3, 4, 5, ... up to the recompile limit.
    need("transformers")
    torch.manual_seed(0)
    tiled = TiledMLP(GatedMLP(8, 20).double(), num_shards=2)
    tiled(torch.randn(1, 9, 8, dtype=torch.float64))  # a tiled call: the registration hook is installed
    ids = token_ids()
    labels = ids.clone()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(tiny_model("gemma"), backend=counter)
    frames = []
    for _ in range(4):
        compiled(input_ids=ids, labels=labels).loss.backward()
        frames.append(counter.frame_count)
    assert frames == [frames[0]] * 4, frames
