"""Which training framework a test needs, and whether its absence may skip the test.

A framework test imports the real package (TRL, ms-swift, Axolotl, ...). Each framework pins its own
transformers, so some run only in an environment of their own (`.ci/run` makes one per such framework).
Where the package is missing the test skips, unless ``TILED_MLP_REQUIRE`` names it (a comma-separated list
of import names, set by `.ci/run` for the environment it built for that framework): a broken install
then fails the run instead of skipping quietly.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest


def required_here() -> set:
    return {name.strip() for name in os.environ.get("TILED_MLP_REQUIRE", "").split(",") if name.strip()}


def need(import_name: str) -> ModuleType:
    """The framework's top-level module; skips the test where it is missing and not required."""
    if importlib.util.find_spec(import_name) is None:
        if import_name in required_here():
            raise RuntimeError(f"TILED_MLP_REQUIRE names {import_name!r} but it cannot be imported here")
        pytest.skip(f"{import_name} is not installed in this environment")
    return importlib.import_module(import_name)
