"""``tiled-mlp bench --compile``: the four variants, the ratios against the compile targets, the gradient
error, the allocator peak (checked against the exact live-storage tracker where both can see), and the
flags the mode refuses before any work.

``aot_eager`` traces what inductor would be given without generating code (inductor takes minutes on two
cores); the measurement itself does not depend on the backend.
"""
from __future__ import annotations

import json

import pytest
import torch
from cli_errors import refuse_bench_work, usage_error

from tiled_mlp.bench.compiled import VARIANTS, CompileBenchConfig, allocated_peak_bytes, build_variants
from tiled_mlp.bench.measure import make_inputs, peak_bytes
from tiled_mlp.cli.main import main

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_dynamo")]

TINY = ["--hidden", "16", "--intermediate", "40", "--seq", "64", "--num-shards", "4", "--repeats", "2",
        "--compile-backend", "aot_eager"]


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("float64", 1e-12)])
def test_json_has_four_variants_ratios_and_matching_gradients(capsys, dtype, bound):
    assert main(["bench", "--compile", *TINY, "--dtype", dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["backend"] == "aot_eager" and report["config"]["dtype"] == dtype
    assert list(report["variants"]) == list(VARIANTS)
    for row in report["variants"].values():
        assert row["ms"] > 0 and row["peak_mb"] > 0 and row["grad_rel_err"] < bound
    variants = report["variants"]
    want = {"compiled_tiled/compiled_untiled": (1.20, variants["compiled_untiled"]),
            "compiled_tiled/eager_tiled": (1.00, variants["eager_tiled"])}
    assert set(report["time"]) == set(want)
    for key, (target, base) in want.items():
        check = report["time"][key]
        assert check["target"] == target
        assert check["ratio"] == pytest.approx(variants["compiled_tiled"]["ms"] / base["ms"])
        assert check["verdict"] == ("PASS" if check["ratio"] <= target else "MISS")
    memory = report["memory"]
    assert memory["num_shards"] == 4 and memory["shard_tokens"] == 16  # it did tile
    assert memory["one_shard_buffers_mb"] * 2**20 == 4 * 16 * 40 * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # The tiled peak, eager or compiled, is below the untiled one at 4 shards.
    assert variants["compiled_tiled"]["peak_mb"] < variants["eager_untiled"]["peak_mb"]
    assert isinstance(report["explain"]["graph_count"], int) and isinstance(report["explain"]["graph_break_count"], int)


def test_text_report_names_targets_and_verdicts(capsys):
    assert main(["bench", "--compile", *TINY, "--no-progress"]) == 0
    out = capsys.readouterr().out
    for words in ("| compiled_tiled |", "compiled_tiled/compiled_untiled:", "(target <= 1.20)",
                  "compiled_tiled/eager_tiled:", "(target <= 1.00)", "one shard's buffers (4 shards of 16 tokens)",
                  "dynamo explain (compiled tiled):"):
        assert words in out
    assert out.count("PASS") + out.count("MISS") == 2


@pytest.mark.parametrize("name", ["eager_untiled", "eager_tiled"])
def test_allocator_peak_equals_the_live_storage_peak_of_eager_steps(name):
    """Where the dispatch-mode tracker sees every buffer (eager ops), the profiler's allocator peak agrees
    to the byte: same accounting (input, grad_output, weights, grads), so its compiled peaks compare."""
    cfg = CompileBenchConfig(hidden=32, intermediate=88, seq=256, num_shards=4)
    mlp, modules = build_variants(cfg)
    x, grad_out = make_inputs(cfg.seq, cfg.hidden, cfg.dtype, "cpu")
    assert allocated_peak_bytes(modules[name], mlp, x.detach(), grad_out) == peak_bytes(modules[name], mlp, x, grad_out)


# -- flags refused before any work ---------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    refuse_bench_work(monkeypatch)


@pytest.mark.parametrize("extra, expect", [
    (["--model-memory"], "it cannot be combined with --model-memory: drop --model-memory or drop --compile"),
    (["--impls", "untiled,auto"], "it cannot be combined with --impls: drop --impls or drop --compile"),
    (["--tp", "2"], "it cannot be combined with --tp: drop --tp or drop --compile"),
    (["--plot", "x.png"], "it cannot be combined with --plot: drop --plot or drop --compile"),
    (["--seq", "64,128"], "--compile measures one sequence length, got 2 (64,128); pass a single --seq"),
    (["--compile-backend", "no_such_backend"], "unknown torch.compile backend 'no_such_backend'; available: "),
])
def test_bad_combinations_are_refused_by_name(capsys, no_work, extra, expect):
    err = usage_error(capsys, ["bench", "--compile", "--hidden", "16", "--intermediate", "40", *extra])
    assert expect in err
    if "available" in expect:
        assert "aot_eager" in err and "inductor" in err


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_backend_without_compile_is_refused(capsys, no_work, backend):
    err = usage_error(capsys, ["bench", "--compile-backend", backend])
    assert "--compile-backend chooses the backend of --compile: add --compile" in err


def test_defaults_differ_by_mode(monkeypatch):
    """--compile measures the size its targets were set at unless told otherwise; the table mode keeps its own defaults."""
    from tiled_mlp.cli import bench_cmd, bench_compile_cmd

    seen = {}

    class Stop(Exception):
        pass

    def capture(key):
        def run(cfg, show_progress=True):
            seen[key] = cfg
            raise Stop

        return run

    monkeypatch.setattr(bench_compile_cmd, "run_compile_bench", capture("compile"))
    monkeypatch.setattr(bench_cmd, "run_bench", capture("table"))
    for argv in (["bench", "--compile"], ["bench"], ["bench", "--compile", "--hidden", "64", "--seq", "128"]):
        with pytest.raises(Stop):
            main(argv)
        key = "compile" if "--compile" in argv else "table"
        seen[tuple(argv)] = seen.pop(key)
    compiled = seen[("bench", "--compile")]
    assert (compiled.hidden, compiled.intermediate, compiled.seq, compiled.backend) == (1024, 2816, 8192, "inductor")
    table = seen[("bench",)]
    assert (table.hidden, table.intermediate, table.seqs) == (512, 1408, [1024, 2048, 4096, 8192])
    given = seen[("bench", "--compile", "--hidden", "64", "--seq", "128")]
    assert (given.hidden, given.intermediate, given.seq) == (64, 2816, 128)
