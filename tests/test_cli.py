"""The tiled-mlp command: clear argument errors, parseable JSON, and plan's prediction against a
measured peak."""
import importlib.util
import json

import pytest
import torch
from cli_errors import refuse_bench_work, usage_error

from tiled_mlp.bench.measure import make_inputs, peak_bytes
from tiled_mlp.bench.mlp import SwiGLUMLP
from tiled_mlp.cli.main import main
from tiled_mlp.core import TiledMLP

pytestmark = pytest.mark.timeout(120)


def test_negative_sequence_length_is_named(capsys):
    err = usage_error(capsys, ["bench", "--seq", "2048,-5"])
    assert "sequence lengths must be positive integers" in err and "-5" in err


def test_unknown_dtype_lists_the_known_ones(capsys):
    err = usage_error(capsys, ["plan", "--hidden", "64", "--intermediate", "128", "--seq", "64", "--dtype", "fp8"])
    assert "unknown dtype 'fp8'" in err and "bfloat16" in err


def test_budget_too_small_even_at_one_token_per_shard(capsys):
    err = usage_error(capsys, ["plan", "--hidden", "4096", "--intermediate", "12288", "--seq", "131072", "--budget", "3GiB"])
    assert "too small even with one token per shard" in err and "4.56 GiB" in err


def test_malformed_budget_and_unknown_impl(capsys):
    assert "expected a size: 80 (GiB), 80GiB" in usage_error(
        capsys, ["plan", "--hidden", "64", "--intermediate", "128", "--seq", "64", "--budget", "lots"])
    assert "unknown or unavailable implementation(s) nope" in usage_error(capsys, ["bench", "--impls", "untiled,nope"])


def test_demo_strategy_needs_several_processes(capsys):
    pytest.importorskip("transformers")
    assert "needs --nproc 2 or more" in usage_error(capsys, ["demo", "--strategy", "fsdp2"])


def test_demo_sequence_parallelism_shares_one_sequence(capsys):
    """The one-process run the SP demo is compared with trains one sequence a step: --nproc must equal --sp."""
    pytest.importorskip("transformers")
    assert "needs --nproc 2" in usage_error(capsys, ["demo", "--sp", "2", "--nproc", "4"])
    assert "must divide the demo's 4 attention heads" in usage_error(capsys, ["demo", "--sp", "3", "--nproc", "3"])


def test_bench_json_parses_and_reports_matching_gradients(capsys, tmp_path):
    plot = tmp_path / "bench.png"
    argv = ["bench", "--hidden", "32", "--intermediate", "96", "--seq", "64,256", "--impls", "untiled,fast,generic",
            "--num-shards", "3", "--repeats", "1", "--json"]
    with_plot = importlib.util.find_spec("matplotlib") is not None  # the plot alone is optional
    if with_plot:
        argv += ["--plot", str(plot)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert {(r["seq"], r["impl"]) for r in rows} == {(s, i) for s in (64, 256) for i in ("untiled", "fast", "generic")}
    for row in rows:
        assert row["grad_rel_err"] < 1e-5 and row["peak_mb"] > 0 and row["ms"] > 0
        assert row["num_shards"] == (1 if row["impl"] == "untiled" else 3)
    if with_plot:
        assert plot.stat().st_size > 10_000


@pytest.mark.parametrize("seq", [512, 4096])
def test_plan_agrees_with_a_measured_peak(capsys, seq):
    """plan's fake-tensor prediction against the peak of a real CPU step, both tiled (auto) and untiled."""
    hidden, intermediate = 64, 256
    assert main(["plan", "--hidden", str(hidden), "--intermediate", str(intermediate), "--seq", str(seq),
                 "--dtype", "float32", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)

    torch.manual_seed(0)
    mlp = SwiGLUMLP(hidden, intermediate)
    x, grad_out = make_inputs(seq, hidden, torch.float32, "cpu")
    measured_untiled = peak_bytes(mlp, mlp, x, grad_out)
    tiled = TiledMLP(mlp, num_shards=plan["auto_num_shards"], path="fast") if not plan["auto_runs_untiled"] else mlp
    measured_auto = peak_bytes(tiled, mlp, x, grad_out)
    assert abs(plan["untiled_peak_bytes"] - measured_untiled) <= 0.05 * measured_untiled
    assert abs(plan["auto_peak_bytes"] - measured_auto) <= 0.05 * measured_auto


# -- errors caught before any work ---------------------------------------------------------------------
@pytest.fixture
def no_bench_work(monkeypatch):
    """Running the benchmark or drawing its plot fails the test: the errors below must come before them."""
    refuse_bench_work(monkeypatch)


@pytest.mark.parametrize("hidden, expect", [
    ("100000000", "one untiled step needs 21,457.7 GiB (modelled), more than this machine's memory"),
    ("1e8", "argument --hidden: expected a positive integer, got '1e8'"),
])
def test_bench_sizes_no_machine_holds_are_refused_before_the_run(capsys, no_bench_work, hidden, expect):
    err = usage_error(capsys, ["bench", "--hidden", hidden])
    assert expect in err and "Traceback" not in err


@pytest.mark.parametrize("hidden, expect", [("130", "--hidden 130 is not a multiple of the demo's attention heads (4)"),
                                            ("132", "heads of 33 features, and rotary position embeddings need an even")])
def test_demo_hidden_must_split_into_its_heads(capsys, monkeypatch, hidden, expect):
    pytest.importorskip("transformers")
    from tiled_mlp.cli import demo_train

    monkeypatch.setattr(demo_train, "report", lambda *a, **k: pytest.fail("the demo trained before the error"))
    err = usage_error(capsys, ["demo", "--hidden", hidden])
    assert expect in err and "use a multiple of 8, e.g. 128" in err


def test_bench_checkpointed_heads_must_split_hidden(capsys, monkeypatch):
    from tiled_mlp.cli import checkpointed_cmd

    monkeypatch.setattr(checkpointed_cmd, "run", lambda *a, **k: pytest.fail("the benchmark ran before the error"))
    err = usage_error(capsys, ["bench-checkpointed", "--hidden", "100", "--heads", "8"])
    assert "the llama-layer region: --hidden 100 is not a multiple of --heads (8)" in err
    assert "llama-layer" in usage_error(capsys, ["bench-checkpointed", "--hidden", "24", "--heads", "8"])
    # The MLP-only region has no heads to split.
    monkeypatch.setattr(checkpointed_cmd, "run", lambda *a, **k: [])
    monkeypatch.setattr(checkpointed_cmd, "format_rows", lambda rows: "")
    assert main(["bench-checkpointed", "--regions", "mlp-half", "--hidden", "100", "--heads", "8", "--repeats", "1"]) == 0


@pytest.mark.parametrize("impls", [",", "", " , ,"])
def test_empty_impls_list_the_known_ones(capsys, no_bench_work, impls):
    err = usage_error(capsys, ["bench", "--impls", impls])
    assert "--impls names no implementation" in err and "untiled, " in err and "fast" in err


@pytest.mark.parametrize("device", ["nonsense", "cuda0", "gpu"])
def test_unknown_device_names_what_is_available(capsys, no_bench_work, device):
    err = usage_error(capsys, ["bench", "--device", device])
    assert f"unknown device {device!r}" in err and "available here: cpu" in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("tiled-mlp bench: error: unknown device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_names_what_is_available(capsys, no_bench_work):
    err = usage_error(capsys, ["bench", "--device", "cuda"])
    assert "device 'cuda' is not available" in err and "available here: cpu" in err


def test_device_index_out_of_range(capsys, monkeypatch, no_bench_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = usage_error(capsys, ["bench", "--device", "cuda:2"])
    assert "device 'cuda:2' does not exist" in err and "cuda:0" in err and "cuda:1" in err


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="fake CUDA tensors work where torch is built with CUDA")
def test_model_memory_on_a_device_torch_cannot_fake(capsys, no_bench_work):
    err = usage_error(capsys, ["bench", "--model-memory", "--device", "cuda", "--hidden", "16", "--intermediate", "32",
                          "--seq", "64"])
    assert "--model-memory cannot model device 'cuda'" in err


def test_plot_without_matplotlib_fails_before_the_benchmark(capsys, monkeypatch, no_bench_work, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "matplotlib" else find_spec(name, *a, **k))
    err = usage_error(capsys, ["bench", "--plot", str(tmp_path / "out.png")])
    assert "--plot needs matplotlib" in err and "pip install 'tiled-mlp[bench]'" in err


def test_plot_to_a_missing_folder_or_unknown_format_fails_before_the_benchmark(capsys, no_bench_work, tmp_path):
    pytest.importorskip("matplotlib")
    err = usage_error(capsys, ["bench", "--plot", str(tmp_path / "missing" / "out.png")])
    assert "--plot" in err and "no such folder" in err
    err = usage_error(capsys, ["bench", "--plot", str(tmp_path / "out.docx")])
    assert "--plot" in err and "'docx'" in err and "png" in err


@pytest.mark.parametrize("command", [["bench"], ["demo"]])
@pytest.mark.parametrize("shards, words", [("2.7", ["whole number"]), ("0", [">= 1"]), ("many", ["'many'", "'auto'"])])
def test_num_shards_goes_through_the_one_parser(capsys, no_bench_work, command, shards, words):
    err = usage_error(capsys, [*command, "--num-shards", shards])
    assert "argument --num-shards: num_shards must be" in err and all(w in err for w in words), err


def test_num_shards_auto_in_any_case():
    from tiled_mlp.cli.main import build_parser

    assert build_parser().parse_args(["bench", "--num-shards", " AUTO "]).num_shards == "auto"


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0", "fast"])
def test_demo_learning_rate_must_be_a_positive_finite_number(capsys, monkeypatch, lr):
    from tiled_mlp.cli import demo_train

    monkeypatch.setattr(demo_train, "report", lambda *a, **k: pytest.fail("the demo trained before the error"))
    err = usage_error(capsys, ["demo", "--lr", lr])
    assert "argument --lr: expected a positive number" in err and repr(lr) in err


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the DeepSpeed peer needs deepspeed")
def test_bench_checkpointed_counts_mlp_forwards_per_step(capsys, tmp_path):
    """One checkpointed MLP half, tiny: untiled runs the MLP forward twice (forward, checkpoint
    recompute), DeepSpeed's TiledMLP three times, ours twice (the recompute stops before it)."""
    code = main(["bench-checkpointed", "--regions", "mlp-half", "--hidden", "32", "--intermediate", "64",
                 "--seq", "2048", "--num-shards", "4", "--repeats", "1", "--plot", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert code == 0 and (tmp_path / "c.png").exists()
    rows = {line.split("|")[2].strip(): line.split("|")[4].strip() for line in out.splitlines()
            if line.startswith("| mlp-half")}
    assert rows == {"untiled": "2", "ours": "2", "deepspeed": "3"}, out


def test_bench_checkpointed_names_bad_regions_and_needs_untiled(capsys):
    assert "unknown or empty" in usage_error(capsys, ["bench-checkpointed", "--regions", "attention"])
    assert "must include untiled" in usage_error(capsys, ["bench-checkpointed", "--impls", "ours"])


def test_bench_overhead_reports_every_measurement(capsys):
    assert main(["bench-overhead", "--calls", "3"]) == 0
    out = capsys.readouterr().out
    for name in ("pass-through overhead", "tiled overhead over kernel work", "kernel work forward+backward"):
        assert f"| {name}" in out, out
