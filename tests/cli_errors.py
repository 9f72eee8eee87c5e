"""A tiled-mlp command refused as a usage error: exit status 2, a message and no traceback, and (with
``refuse_bench_work``) before any benchmark work."""
import pytest

from tiled_mlp.cli.main import main


def usage_error(capsys, argv) -> str:
    """The error text of ``tiled-mlp argv``, which must exit with argparse's usage status."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def refuse_bench_work(monkeypatch) -> None:
    """Running a benchmark (eager or compiled) or drawing its plot fails the test."""
    from tiled_mlp.cli import bench_cmd, bench_compile_cmd

    def refuse(*args, **kwargs):
        raise AssertionError("benchmark work ran before the argument error")

    monkeypatch.setattr(bench_cmd, "run_bench", refuse)
    monkeypatch.setattr(bench_cmd, "plot", refuse)
    monkeypatch.setattr(bench_compile_cmd, "run_compile_bench", refuse)
