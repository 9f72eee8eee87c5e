"""Independent parts of a plan modelled side by side, in forked worker processes.

A plan's settings share nothing once the planner has checked the model: each setting's table points
and its search are steps of its own (a tiled setting and its untiled twin, which may share steps, go
together: ``pass_through.twin_groups``). The workers are forked from the planner as it stands, so each
starts with what the parent built (the config, the meta models, the checks' results) instead of
importing torch and transformers again, which is most of a spawned process's first three seconds.
Only a task's index goes to a worker, and what it returns (points, plain data) comes back pickled.

Forking a process with threads is safe only when the child needs nothing those threads hold. torch
starts native threads at import (Python 3.12 and later warn at every such fork, PyTorch's own
``DataLoader`` workers' included); a worker here runs meta-device steps only, which take no intra-op thread
pool or device lock, and it never returns to the parent's code (the pool's worker loop ends in
``os._exit``). Where workers are not forked (``can_fork``) or one worker is asked for, the tasks run
in this process, in order: the same code and the same results.

A worker that dies (killed, out of memory) stops the plan with an error that says so, never a hang.
"""
from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import multiprocessing
import os
import pickle
import sys
import warnings
from typing import Any, Callable, List, Optional, Sequence, TypeVar

R = TypeVar("R")
# A task gets the function that reports its progress labels.
Task = Callable[[Callable[[str], None]], Any]

# Set in the parent just before the pool forks, so that the workers hold them without pickling.
_tasks: Sequence[Task] = ()
_labels: Optional[Any] = None  # a SimpleQueue of the fork context
_POLL_S = 0.02  # how often the parent shows the workers' progress


def available() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def can_fork() -> bool:
    """Whether workers are forked here: not on Windows (no fork), nor on macOS, whose system libraries
    start threads of their own that a forked child can crash on (Python's own default there is spawn)."""
    return "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin"


def run_tasks(tasks: Sequence[Callable[[Callable[[str], None]], R]], on_label: Callable[[str], None],
              workers: int) -> List[R]:
    """Each ``task(report)``'s result, in the order of ``tasks``, computed by up to ``workers`` forked
    processes; ``on_label`` gets every label a task reports, in this process, as the tasks run. The first
    task (in their order) that raised has its exception raised here, once the running tasks are done; the
    tasks not started by then are not run."""
    global _tasks, _labels
    if workers <= 1 or len(tasks) <= 1 or not can_fork():
        return [task(on_label) for task in tasks]
    context = multiprocessing.get_context("fork")
    _tasks, _labels = tasks, context.SimpleQueue()
    try:
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)), mp_context=context) as pool, \
                warnings.catch_warnings():
            # The fork itself, at the first submit: see the module's doc for why it is safe here.
            warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
            futures = [pool.submit(_run, index) for index in range(len(tasks))]
            pending = set(futures)
            while pending:
                # The labels are read until every task is done, even after one failed: a worker whose labels
                # filled the pipe would otherwise wait on it for ever.
                _, pending = concurrent.futures.wait(pending, timeout=_POLL_S)
                _show(on_label)
                if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                    for future in pending:
                        future.cancel()  # those not started; the running ones end on their own
            # A worker puts its labels (synchronously) before its result is sent: all are here now.
            _show(on_label)
            try:
                return [f.result() for f in futures if not f.cancelled()]
            except concurrent.futures.process.BrokenProcessPool as error:
                raise RuntimeError(
                    f"a worker process modelling the plan died ({error}); each holds its own steps' logs, about "
                    "1.5 GiB at ALST's million-token rows: give fewer workers (tiled-mlp plan --workers N), or 1 to "
                    "model everything in this process") from error
    finally:
        _tasks, _labels = (), None


def _run(index: int) -> Any:
    labels = _labels
    assert labels is not None, "a worker is forked after the tasks are set"
    try:
        return _tasks[index](labels.put)
    except Exception as error:
        try:
            pickle.dumps(error)
        except Exception:
            # What cannot be sent back (an exception holding a torch op, say) is sent as its type and message,
            # which the parent would otherwise lose to a pickling error.
            raise RuntimeError(f"{type(error).__module__}.{type(error).__qualname__}: {error}") from None
        raise


def _show(on_label: Callable[[str], None]) -> None:
    assert _labels is not None
    while not _labels.empty():
        on_label(_labels.get())
