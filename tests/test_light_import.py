"""``import tiled_mlp`` loads the library alone: no tool (planner, bench, cli) and nothing of torch.compile
(Dynamo, Inductor, sympy: about 1 s). What the traced routes need from Dynamo is marked as Dynamo's own
decorators mark it, or made at the first call (``dynamo_support``); each is checked here against Dynamo's own.

The import time itself is a benchmark (``python -X importtime -c 'import torch; import tiled_mlp'``), not a test."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiled_mlp.core import dynamo_support

ROOT = Path(__file__).resolve().parent.parent
NOT_LOADED = ("torch._dynamo", "torch._inductor", "sympy", "tiled_mlp.planner", "tiled_mlp.bench", "tiled_mlp.cli")


def test_import_loads_neither_the_tools_nor_the_compiler():
    code = f"import sys, torch, tiled_mlp; print([m for m in {NOT_LOADED!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_constant_mark_is_dynamos():
    def ours():
        pass

    def dynamos():
        pass

    assert dynamo_support._marked_constant(ours) is ours
    assert torch._dynamo.assume_constant_result(dynamos) is dynamos
    assert vars(ours) == vars(dynamos) and vars(ours)


def _times_five(x):
    return x * 5


def _times_five_unmarked(x):
    return x * 5


dynamo_support.run_eagerly_at_top_level(_times_five.__code__)


def graphs_of(function, x) -> list:
    """The ops of each graph Dynamo compiles for ``function(x)``."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append([node.target.__name__ for node in gm.graph.nodes if node.op == "call_function"])
        return gm

    function(x)
    torch.compile(function, backend=backend)(x)
    return graphs


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("times_five, compiled_at_top", [(_times_five, []), (_times_five_unmarked, [["mul"]])])
def test_a_frame_run_eagerly_at_top_level_is_skipped_there_and_inlined_where_traced(times_five, compiled_at_top):
    @torch.compiler.disable(recursive=False)  # a frame Dynamo skips, whose callees it compiles at the top level
    def skipped(x):
        return times_five(x + 1)

    def after_a_break(x):
        return skipped(x) - 1

    def traced(x):
        return times_five(x) - 1

    assert graphs_of(after_a_break, torch.ones(2)) == compiled_at_top + [["sub"]]
    assert graphs_of(traced, torch.ones(2)) == [["mul", "sub"]]


@pytest.mark.usefixtures("fresh_dynamo")
def test_disable_is_a_graph_break_then_an_eager_call():
    calls = []

    @dynamo_support.disable
    def eager(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    def f(x):
        return eager(x * 2) * 3

    def g(x):
        return eager(x * 2) * 3

    assert graphs_of(f, torch.ones(2)) == [["mul"], ["mul"]]
    assert torch.equal(torch.compile(f, backend="eager")(torch.ones(2)), torch.full((2,), 9.0))
    assert calls == [False] * 3  # eager, then the compiled call twice, each time outside the graph
    with pytest.raises(Exception, match="skipped"):
        torch.compile(g, backend="eager", fullgraph=True)(torch.ones(2))
