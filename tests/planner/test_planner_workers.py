"""The forked workers that model a plan's parts side by side (``tiled_mlp/planner/workers.py``): results
in the tasks' order from other processes, every progress label shown here, a task's error raised here,
a dead worker an error rather than a hang, and one worker meaning this process."""
from __future__ import annotations

import functools
import os
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from tiled_mlp.planner.workers import can_fork, run_tasks

pytestmark = pytest.mark.timeout(60)
forking = pytest.mark.skipif(not can_fork(), reason="no fork start method on this platform")


def _task(index: int, report) -> tuple:
    report(f"task {index} begins")
    report(f"task {index} ends")
    return index * index, os.getpid()


def _failing(report) -> None:
    raise ValueError("a step of this setting cannot be modelled: named here")


def _dying(report) -> None:
    os._exit(3)


@forking
def test_results_come_in_the_tasks_order_from_forked_processes_with_every_label():
    labels = []
    done = run_tasks([functools.partial(_task, k) for k in range(5)], labels.append, workers=2)
    assert [value for value, _ in done] == [k * k for k in range(5)]
    pids = {pid for _, pid in done}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert sorted(labels) == sorted(f"task {k} {when}" for k in range(5) for when in ("begins", "ends"))


@forking
def test_a_tasks_error_is_raised_here_with_its_message():
    with pytest.raises(ValueError, match="cannot be modelled: named here"):
        run_tasks([functools.partial(_task, 0), _failing], lambda label: None, workers=2)


@forking
def test_a_worker_that_dies_stops_the_run_with_an_error():
    with pytest.raises(RuntimeError, match="worker process modelling the plan died") as raised:
        run_tasks([_dying, functools.partial(_task, 1)], lambda label: None, workers=2)
    assert isinstance(raised.value.__cause__, BrokenProcessPool)


def test_one_worker_runs_every_task_here_in_order():
    labels = []
    done = run_tasks([functools.partial(_task, k) for k in range(3)], labels.append, workers=1)
    assert done == [(k * k, os.getpid()) for k in range(3)]
    assert labels == [f"task {k} {when}" for k in range(3) for when in ("begins", "ends")]


def _reporting(count: int, report, after_s: float = 0.0) -> int:
    time.sleep(after_s)
    for k in range(count):
        report(f"a label long enough to fill a pipe when sent often enough: {k:06d}")
    return count


@forking
def test_a_tasks_error_waits_for_the_running_tasks_without_a_hang_and_skips_the_rest():
    # The other worker sends far more than a pipe holds (64 KiB), starting after the first task failed.
    labels = []
    tasks = [_failing, functools.partial(_reporting, 5000, after_s=0.5)] + [_sleeping] * 20
    with pytest.raises(ValueError, match="cannot be modelled"):
        run_tasks(tasks, labels.append, workers=2)
    assert sum(1 for label in labels if label.endswith("004999")) == 1, "the running task's labels all came"
    # The pool queues a few tasks ahead of its workers (those run); the other 15 or more are cancelled.
    assert labels.count("slept") < 8, "tasks not started when the error came were not run"


def _sleeping(report) -> None:
    time.sleep(0.5)
    report("slept")


def _unpicklable(report) -> None:
    class Local(Exception):  # a class pickle cannot find by name
        pass

    raise Local("what went wrong, kept")


@forking
def test_an_exception_that_cannot_be_sent_back_keeps_its_type_and_message():
    with pytest.raises(RuntimeError, match="Local: what went wrong, kept"):
        run_tasks([_unpicklable, functools.partial(_task, 1)], lambda label: None, workers=2)
