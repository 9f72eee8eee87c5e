import os
from pathlib import Path

import pytest

from integration_tests.deepspeed_cpu import pin_fp16_support

# DeepSpeed JIT-builds a shared-memory op the first time a process initialises it (~40 s with g++):
# one build cache for the whole test run, shared by every xdist worker and spawned rank.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).parent / ".torch_extensions"))

# DeepSpeed's CPU accelerator answers "fp16 supported?" by the CPU's instruction set, and ZeRO-3 branches on
# it: the same answer on every machine (spawned ranks pin it too, integration_tests/spawn.py).
pin_fp16_support()


# The test extras. Their tests skip where one is missing (the core alone: `tox -e core`); CI sets
# TILED_MLP_REQUIRE_EXTRAS=1 so that a broken install fails the run instead of skipping quietly.
EXTRAS = ("deepspeed", "accelerate", "transformers", "peft", "matplotlib")


def pytest_sessionstart(session):
    if os.environ.get("TILED_MLP_REQUIRE_EXTRAS") != "1":
        return
    import importlib.util

    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"TILED_MLP_REQUIRE_EXTRAS=1 but {', '.join(missing)} cannot be imported: their tests would be "
            "skipped. Install the extras (bash .ci/setup) or unset the variable to run the core alone."
        )


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied around a test (``pytest.mark.usefixtures("fresh_dynamo")``): a graph compiled by
    one test, and the guards it rests on, never serve another."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_collector():
    """The cyclic garbage collector off around a test: only reference counts free anything, so a reference cycle
    keeping a deleted model alive shows (tests/test_freed_on_delete*.py)."""
    import gc

    from tiled_mlp.planner.collector import collector_paused

    gc.collect()
    with collector_paused():
        yield


@pytest.fixture(scope="session")
def llama_built_once():
    """One tiny Llama built and dropped, with the collector on, before a test that checks what a deleted model frees:
    the first build of a transformers model class in a process leaves frames of its own build alive in a cycle (an
    exception caught while importing), which hold that first model until the collector runs. An untiled control
    built first in its process then fails."""
    import gc
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return
    from integration_tests.tiny_models import FAMILIES

    FAMILIES["llama"].build()
    gc.collect()
