"""``tiled-mlp plan --json`` prints one JSON document on stdout, whatever other libraries log (DeepSpeed
logs at import, through a handler of its own): the real command, in a process of its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from integration_tests.tiny_models import small_planner_llama  # noqa: E402

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # the repository


def _plan_process(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tiled_mlp.cli.main", "plan", *argv, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_plan_json_of_a_model_is_json_on_stdout(tmp_path):
    config = small_planner_llama(4)
    config.save_pretrained(tmp_path)
    # Under --sp, DeepSpeed's attention is imported during the plan, and DeepSpeed logs to stdout.
    done = _plan_process("--model", str(tmp_path / "config.json"), "--seq", "256", "--budget", "1", "--sp", "2",
                 "--world-size", "2")
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert records[-1]["max_seq"] > 0 and "Setting accelerator" in done.stderr


def test_plan_json_of_one_mlp_is_json_on_stdout():
    done = _plan_process("--hidden", "64", "--intermediate", "176", "--seq", "512")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["hidden"] == 64


@pytest.mark.parametrize("returned, code", [(3, 3), (None, 0), (True, 1), ("a message", 1)])
def test_the_command_runs_the_exit_functions_and_keeps_its_code_when_it_leaves_early(returned, code):
    # ``run`` exits the ordinary way: what an exit must do still happens, and the code is what sys.exit makes of
    # what the command returned (a message goes to stderr).
    script = ("import atexit, sys\n"
              "from tiled_mlp.cli import main\n"
              "atexit.register(lambda: print('exit functions ran', flush=True))\n"
              f"main.main = lambda: (print('the answer'), {returned!r})[1]\n"
              "main.run()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines() == ["the answer", "exit functions ran"]
    assert ("a message" in done.stderr.splitlines()) == (returned == "a message"), done.stderr
