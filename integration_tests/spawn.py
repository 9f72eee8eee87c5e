"""Run a function on several CPU processes with the gloo backend, bounded in time.

Processes rendezvous through a file store under the test's own ``tmp_path`` (no ports), so tests run
in parallel under pytest-xdist. Each rank's return value is saved with ``torch.save`` and handed
back to the test; an exception in any rank fails the test with that rank's traceback.

Ranks are forked from a server process (multiprocessing's ``forkserver``) that has imported torch,
transformers, accelerate, peft and tiled_mlp, once per test process: a spawned rank spent 1.5 to 4.7 s
importing them, most of what a distributed test cost on 2 cores (the suite: 8 min 41 s spawned, 4 min
34 s forked, on 2 cores). The server only imports: it runs no op and makes no process group (the one
thread torch starts at import is the one every forked DataLoader worker's parent has). What a fork
shares that a spawn would not is made per rank again: the environment is the test process's at the
run (only the preloaded modules' imports read the server's, taken when it started), and torch's and
NumPy's generators are seeded afresh, as a new interpreter's are (Python's ``random`` reseeds itself at
a fork). Python's string hashing seed cannot be: the ranks of one test process share it, so a set of
names iterates in the same order on every rank, where spawned ranks could differ. DeepSpeed is not
preloaded: the library's DeepSpeed paths begin by asking whether it is imported, and a rank imports it
only where its test does, as a user's process would.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, fn: Callable, workdir: str, args: tuple, environment: Dict[str, str]) -> None:
    import torch.distributed as dist

    from .deepspeed_cpu import pin_fp16_support

    os.environ.clear()
    os.environ.update(environment)
    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()

    pin_fp16_support()  # as in the test process (conftest.py): DeepSpeed behaves alike on every CPU
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Names DeepSpeed and accelerate read when they find an initialised process group.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    out = Path(workdir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        dist.barrier()  # without it a rank can abort at exit
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is saved: leave without running C++ static destructors. A gloo process aborts at exit
    # now and then ("terminate called without an active exception", SIGABRT, measured about 1 run in 8 of
    # test_third_party_strategy), after its work and its result are done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Imported once by the server; one that is not installed is skipped (the server ignores ImportError).
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama", "accelerate",
            "peft", "tiled_mlp", "integration_tests.spawn"]


def run_distributed(fn: Callable, world_size: int, tmp_path, *args: Any, timeout: float = 120.0) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns each rank's result."""
    workdir = Path(tmp_path) / f"dist-{time.monotonic_ns()}"
    workdir.mkdir(parents=True)
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(_worker, args=(world_size, fn, str(workdir), args, dict(os.environ)), nprocs=world_size,
                             join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed run of {fn.__name__} did not finish within {timeout:.0f} s (deadlock?)")
    except mp.ProcessRaisedException:
        pass  # the rank's own traceback is in its result file, reported below
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    results = []
    for rank in range(world_size):
        path = workdir / f"rank{rank}.pt"
        if not path.exists():
            raise RuntimeError(f"rank {rank} of {fn.__name__} exited without a result (killed or crashed)")
        record = torch.load(path, weights_only=False)
        if not record["ok"]:
            raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{record['error']}")
        results.append(record["result"])
    return results
