"""``tiled-mlp gpu-report`` without a GPU: its refusal, its argument checks (all before any work, writing
nothing), the tables it writes into docs/gpu.md from a canned measurement, and its sections composing the
benches (at tiny sizes on the CPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.cli_errors import usage_error
from tiled_mlp.bench import gpu_doc, gpu_sections
from tiled_mlp.cli import gpu_report_cmd
from tiled_mlp.cli.main import main

DOCS = Path(__file__).resolve().parent.parent / "docs"
OLD, NEW = "2026-01-02T03:04:05Z", "2026-02-03T04:05:06Z"
RUNS = {
    OLD: dict(date="2026-01-02", card="NVIDIA H200", driver="580.1", versions={"torch": "2.11.0", "deepspeed": "0.19.8"}),
    NEW: dict(date="2026-02-03", card="NVIDIA H100 80GB HBM3", driver="580.2",
              versions={"torch": "2.13.0", "transformers": "5.25.0", "liger-kernel": "0.8.5"}),
}


def mlp_row(seq: int, untiled_ms: float, auto_shards: int, auto_mem: float, auto_time: float) -> dict:
    cells = {"untiled": dict(seq=seq, impl="untiled", num_shards=1, peak_mb=100.0, ms=untiled_ms, mem_ratio=1.0,
                             time_ratio=1.0, grad_rel_err=0.0),
             "auto": dict(seq=seq, impl="auto", num_shards=auto_shards, peak_mb=100.0 * auto_mem,
                          ms=untiled_ms * auto_time, mem_ratio=auto_mem, time_ratio=auto_time, grad_rel_err=1e-3)}
    return dict(seq=seq, hidden=4096, intermediate=12288, cells=cells)


@pytest.fixture
def no_work(monkeypatch):
    """Any section's measuring fails the test."""
    def refuse(ctx):
        raise AssertionError("a section was measured before the refusal")

    for name, section in gpu_sections.SECTIONS.items():
        monkeypatch.setitem(gpu_sections.SECTIONS, name, gpu_sections.Section(section.title, refuse, 1, 1))


@pytest.fixture
def as_if_cuda(monkeypatch):
    """A machine that passes the CUDA check (the argument checks must still refuse first)."""
    monkeypatch.setattr(gpu_report_cmd, "missing_cuda", lambda: "")


# -- refusal without CUDA -------------------------------------------------------------------------------
def test_refuses_without_cuda_in_one_line_and_writes_nothing(capsys, tmp_path, no_work):
    assert main(["gpu-report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    if torch.version.cuda is None:  # this machine: a CPU-only build
        assert "CPU-only build" in err and torch.__version__ in err
    else:
        assert "no CUDA device" in err
    assert list(tmp_path.iterdir()) == []


def test_a_cuda_build_without_a_device_is_named(capsys, tmp_path, no_work, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tiled-mlp gpu-report: no CUDA device: torch {torch.__version__} (CUDA 12.8) sees no GPU on this machine"
    assert list(tmp_path.iterdir()) == []


# -- argument checks: before the device check and any work ----------------------------------------------
@pytest.mark.parametrize("sections, expect", [("mlp,attention", "unknown or empty (attention)"),
                                              (",", "unknown or empty (none given)")])
def test_bad_sections_are_named(capsys, tmp_path, no_work, as_if_cuda, sections, expect):
    err = usage_error(capsys, ["gpu-report", "--sections", sections, "--out", str(tmp_path)])
    assert expect in err and "choose from mlp, checkpointed, loss, compiled, planner" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("repeats", ["0", "-3", "two"])
def test_repeats_must_be_positive(capsys, tmp_path, no_work, as_if_cuda, repeats):
    err = usage_error(capsys, ["gpu-report", "--repeats", repeats, "--out", str(tmp_path)])
    assert "--repeats" in err and "expected a positive integer" in err


def test_out_must_be_an_existing_directory(capsys, tmp_path, no_work, as_if_cuda):
    missing = tmp_path / "nowhere"
    assert "no such directory" in usage_error(capsys, ["gpu-report", "--out", str(missing)])
    a_file = tmp_path / "gpu.md"
    a_file.write_text("x")
    assert "no such directory" in usage_error(capsys, ["gpu-report", "--out", str(a_file)])
    assert not missing.exists() and a_file.read_text() == "x"


def test_out_must_be_writable(capsys, tmp_path, no_work, as_if_cuda, monkeypatch):
    # os.access stands in for a folder this user cannot write (root can write anywhere: no chmod test).
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode))
    assert "cannot write there" in usage_error(capsys, ["gpu-report", "--out", str(tmp_path)])
    (tmp_path / gpu_doc.DOC).write_text("# GPU\n")
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith(gpu_doc.DOC))
    assert f"{tmp_path / gpu_doc.DOC} cannot be written" in usage_error(capsys, ["gpu-report", "--out", str(tmp_path)])
    assert (tmp_path / gpu_doc.DOC).read_text() == "# GPU\n"


def test_a_store_that_is_not_one_is_refused(capsys, tmp_path, no_work, as_if_cuda):
    (tmp_path / gpu_doc.STORE).write_text("[1, 2]")
    assert "is not a gpu-report store" in usage_error(capsys, ["gpu-report", "--out", str(tmp_path)])
    (tmp_path / gpu_doc.STORE).write_text("{not json")
    assert "Expecting property name" in usage_error(capsys, ["gpu-report", "--out", str(tmp_path)])


# -- the tables -----------------------------------------------------------------------------------------
def canned_store() -> dict:
    """An old run that measured two lengths, a new one that measured one of them again."""
    store = gpu_doc.merge(gpu_doc.empty_store(), OLD, RUNS[OLD],
                          {"mlp": {"2048": mlp_row(2048, 3.12, 1, 1.0, 1.014), "131072": mlp_row(131072, 188.2, 97, 0.218, 1.304)}})
    return gpu_doc.merge(store, NEW, RUNS[NEW], {"mlp": {"131072": mlp_row(131072, 150.0, 32, 0.227, 1.21)}})


def test_a_row_not_measured_keeps_its_figure_marked_with_its_date_and_card():
    block = gpu_doc.render_section("mlp", canned_store(), NEW)
    lines = block.splitlines()
    assert lines[0] == ("_Measured 2026-02-03 on one NVIDIA H100 80GB HBM3, driver 580.2: torch 2.13.0, "
                        "transformers 5.25.0, liger-kernel 0.8.5._")
    assert lines[1] == "_Measured 2026-01-02 on one NVIDIA H200, driver 580.1: torch 2.11.0, deepspeed 0.19.8._"
    rows = [line for line in lines if line.startswith("| 2048") or line.startswith("| 131072")]
    assert rows == ["| 2048 (not measured since 2026-01-02, NVIDIA H200) | 100.0 MiB, 3.12 ms | passes through: 1.000, 1.014 |",
                    "| 131072 | 100.0 MiB, 150.00 ms | 32: 0.227, 1.210 |"]
    assert block.endswith(f"![mlp on the GPU]({gpu_doc.PLOTS['mlp']})")


def test_a_section_no_run_measured_says_so():
    assert "Not measured on a GPU yet" in gpu_doc.render_section("loss", canned_store(), NEW)
    # A section a run did not measure: each of its rows is marked, and the top says so.
    store = gpu_doc.merge(canned_store(), "later", dict(RUNS[NEW], date="2026-05-06", card="Card Y"), {})
    block = gpu_doc.render_section("mlp", store, "later")
    assert block.splitlines()[2] == "_Not measured in the run of 2026-05-06 on Card Y._"
    assert "| 131072 (not measured since 2026-02-03, NVIDIA H100 80GB HBM3) |" in block
    assert "| 2048 (not measured since 2026-01-02, NVIDIA H200) |" in block


def test_the_doc_keeps_its_own_text_and_gains_missing_sections():
    text = "# GPU\n\nprose before\n\n<!-- gpu-report mlp -->\nold table\n<!-- /gpu-report mlp -->\n\nprose after\n"
    out = gpu_doc.update_doc(text, {"mlp": "NEW \\1 TABLE", "loss": "LOSS"}, {"loss": "The loss"})
    assert out == ("# GPU\n\nprose before\n\n<!-- gpu-report mlp -->\nNEW \\1 TABLE\n<!-- /gpu-report mlp -->\n\n"
                   "prose after\n\n## The loss\n\n<!-- gpu-report loss -->\nLOSS\n<!-- /gpu-report loss -->\n")


def test_the_committed_doc_is_the_writers_output_of_the_committed_store(tmp_path):
    for name in (gpu_doc.DOC, gpu_doc.STORE):
        (tmp_path / name).write_text((DOCS / name).read_text())
    store = gpu_doc.load_store(str(tmp_path))
    gpu_doc.write(str(tmp_path), store, None, {n: s.title for n, s in gpu_sections.SECTIONS.items()})
    assert (tmp_path / gpu_doc.DOC).read_text() == (DOCS / gpu_doc.DOC).read_text()
    assert json.loads((tmp_path / gpu_doc.STORE).read_text()) == json.loads((DOCS / gpu_doc.STORE).read_text())


# -- a whole run, its GPU parts stood in for ------------------------------------------------------------
def test_a_run_writes_what_it_measured_and_keeps_the_rest(capsys, tmp_path, monkeypatch, as_if_cuda):
    store = canned_store()
    (tmp_path / gpu_doc.STORE).write_text(json.dumps(store))
    (tmp_path / gpu_doc.DOC).write_text("# GPU\n\nour prose\n")
    monkeypatch.setattr(gpu_report_cmd, "cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(gpu_report_cmd, "this_run", lambda device: dict(RUNS[NEW], date="2026-03-04", card="Card X"))

    def measure(ctx):
        ctx.say("mlp 2048: one measurement")
        return {"2048": mlp_row(2048, 2.0, 1, 1.0, 1.02)}

    monkeypatch.setitem(gpu_sections.SECTIONS, "mlp", gpu_sections.Section("The MLP", measure, 1, 10))
    monkeypatch.setattr(gpu_doc, "plot", lambda folder, store, current: [])
    assert main(["gpu-report", "--sections", "mlp", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "] mlp 2048: one measurement" in err
    doc = (tmp_path / gpu_doc.DOC).read_text()
    assert doc.startswith("# GPU\n\nour prose\n\n## The MLP\n\n<!-- gpu-report mlp -->\n"
                          "_Measured 2026-03-04 on one Card X")
    assert "| 2048 | 100.0 MiB, 2.00 ms | passes through: 1.000, 1.020 |" in doc
    assert "| 131072 (not measured since 2026-02-03, NVIDIA H100 80GB HBM3) | 100.0 MiB, 150.00 ms" in doc
    # The planner's rows were never measured: it says so, and the store keeps every earlier row.
    assert "_Not measured on a GPU yet: `tiled-mlp gpu-report --sections planner`._" in doc
    saved = json.loads((tmp_path / gpu_doc.STORE).read_text())
    assert set(saved["sections"]["mlp"]) == {"2048", "131072"} and len(saved["runs"]) == 3


# -- the sections compose the benches (tiny sizes, CPU) -------------------------------------------------
def test_the_sections_compose_the_benches(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_sections, "MLP_HIDDEN", 32)
    monkeypatch.setattr(gpu_sections, "MLP_INTERMEDIATE", 64)
    monkeypatch.setattr(gpu_sections, "MLP_SEQS", (64, 256))
    monkeypatch.setattr(gpu_sections, "mlp_impls", lambda: ["untiled", "auto"])
    monkeypatch.setattr(gpu_sections, "CHECKPOINTED", dict(hidden=32, intermediate=64, seq=64, heads=4))
    monkeypatch.setattr(gpu_sections, "LOSS_MEMORY_SIZE", (256, 16, 512))
    monkeypatch.setattr(gpu_sections, "LOSS_TIME_SIZE", (64, 16, 256))
    monkeypatch.setattr(gpu_sections, "LOSS_ACCURACY_SIZE", (64, 16, 256))
    lines = []
    ctx = gpu_sections.Context(device=torch.device("cpu"), repeats=1, budget_s=600, say=lines.append)
    measured = {name: gpu_sections.SECTIONS[name].measure(ctx) for name in ("mlp", "checkpointed", "loss")}
    assert set(measured["mlp"]) == {"64", "256"} and set(measured["checkpointed"]) == {"mlp-half", "llama-layer"}
    assert {"untiled", "ours"} <= set(measured["loss"])
    assert any(line.startswith("mlp 256: ") for line in lines) and any(line.startswith("loss: ") for line in lines)
    store = gpu_doc.merge(gpu_doc.empty_store(), NEW, RUNS[NEW], json.loads(json.dumps(measured)))
    for name in measured:
        block = gpu_doc.render_section(name, store, NEW)
        assert "not measured" not in block and block.count("\n|") >= 3, block
    written = gpu_doc.plot(str(tmp_path), store, NEW)
    assert written == [str(tmp_path / gpu_doc.PLOTS["mlp"]), str(tmp_path / gpu_doc.PLOTS["checkpointed"])]
    assert all(os.path.getsize(path) > 0 for path in written)


def test_a_spent_budget_starts_no_new_row(monkeypatch):
    lines = []
    ctx = gpu_sections.Context(device=torch.device("cpu"), repeats=1, budget_s=0, say=lines.append)
    assert gpu_sections.measure_mlp(ctx) == {}
    assert lines == [f"mlp: {seq} tokens skipped (section budget 0 s or the report's spent)" for seq in gpu_sections.MLP_SEQS]
    late = gpu_sections.Context(device=torch.device("cpu"), repeats=1, budget_s=600, say=lines.append, deadline=0)
    assert gpu_sections.measure_checkpointed(late) == {}


# -- the planner section's choice of lengths (meta tensors: no device) ----------------------------------
def test_the_longest_length_is_the_planners_gpu_step_with_the_attention_workspace():
    from tiled_mlp.bench import planner_vs_device as pvd

    budget = 16 * 2**30
    longest = pvd.longest_fitting(budget, 4, cap=1 << 20, fraction=1.0)
    assert longest % pvd.SEQ_STEP == 0 and longest > 0

    def held(seq):
        return pvd.modelled_peak(seq, 4, "tiled+tiled-loss+norms+ckpt")

    assert held(longest) <= budget < held(longest + pvd.SEQ_STEP)
    # The GPU step holds the attention kernels' workspace on top of the CPU step's peak.
    assert held(longest) > pvd.modelled_peak(longest, 4, "tiled+tiled-loss+norms+ckpt", gpu=False)
    assert pvd.longest_fitting(budget, 4, cap=pvd.SEQ_STEP, fraction=1.0) == pvd.SEQ_STEP  # the cap holds
    assert pvd.plan_rows([16384, 65536], longest, untiled_max=16384) == [
        (16384, "untiled+ckpt"), (16384, "tiled+tiled-loss+norms+ckpt"), (65536, "tiled+tiled-loss+norms+ckpt"),
        (longest, "tiled+tiled-loss+norms+ckpt")]


def test_a_rows_modelled_steps_cut_their_shards_as_the_measured_device_does(monkeypatch):
    # The step measured on a device runs the auto policy of that device's class: the modelled steps it is held
    # against must too (a CPU device here; a GPU plan's default is a Hopper-class GPU's).
    from tiled_mlp.bench import planner_vs_device as pvd
    from tiled_mlp.core.auto_shards import CPU

    seen = []

    class Stop(Exception):
        pass

    def modelled(seq, depth, name, gpu=True, shards_as=None):
        seen.append((gpu, shards_as))
        if len(seen) == 2:
            raise Stop  # before the device's own step
        return 0

    monkeypatch.setattr(pvd, "modelled_peak", modelled)
    with pytest.raises(Stop):
        pvd.measure_row(16384, 4, "tiled+tiled-loss+norms+ckpt", torch.device("cpu"))
    assert seen == [(False, CPU), (True, CPU)]


def test_a_failing_section_costs_only_its_own_rows(capsys, tmp_path, monkeypatch, as_if_cuda):
    monkeypatch.setattr(gpu_report_cmd, "cuda_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(gpu_report_cmd, "this_run", lambda device: dict(RUNS[NEW]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def out_of_memory(ctx):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setitem(gpu_sections.SECTIONS, "loss", gpu_sections.Section("The loss", out_of_memory, 1, 10))
    monkeypatch.setitem(gpu_sections.SECTIONS, "mlp", gpu_sections.Section(
        "The MLP", lambda ctx: {"2048": mlp_row(2048, 2.0, 1, 1.0, 1.02)}, 1, 10))
    monkeypatch.setattr(gpu_doc, "plot", lambda folder, store, current: [])
    (tmp_path / gpu_doc.STORE).write_text(json.dumps(canned_store()))
    assert main(["gpu-report", "--sections", "loss", "--out", str(tmp_path)]) == 1  # nothing measured: still written
    assert "_Not measured in the run of 2026-02-03 on NVIDIA H100 80GB HBM3._" in (tmp_path / gpu_doc.DOC).read_text()
    assert main(["gpu-report", "--sections", "loss,mlp", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "loss: FAILED after 0 s: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n" in err
    assert "failed: loss (their rows keep their previous figures)" in err
    assert "| 2048 | 100.0 MiB, 2.00 ms |" in (tmp_path / gpu_doc.DOC).read_text()
