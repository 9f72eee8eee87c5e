"""The design card's layout and one-way imports, read from the source (``ast``), so that a change
that breaks them fails here rather than in a review.

The repository keeps the card's top-level folders, ``tiled_core/`` and ``strategies/``; installed, they
are ``tiled_mlp.core`` and ``tiled_mlp.strategies`` (pyproject's ``package-dir``), so the wheel claims one
name.

- ``tiled_core`` (backend-neutral) imports no backend library (deepspeed, accelerate, transformers,
  peft), no FSDP internals, no backend module of ``strategies`` (only its interface and resolver),
  and not the facade.
- ``strategies`` imports neither the core nor the facade; each backend file holds one strategy.
- Between the three packages the imports form no cycle.
- Nothing imports the folders by their repository names, which would load a second copy of each
  module (two ``TiledMLP`` classes, two registries).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> the name it is installed and imported under.
INSTALLED = {"tiled_core": "tiled_mlp.core", "strategies": "tiled_mlp.strategies", "tiled_mlp": "tiled_mlp"}
CORE, STRATEGIES, FACADE = INSTALLED["tiled_core"], INSTALLED["strategies"], INSTALLED["tiled_mlp"]
CORE_FORBIDDEN = ("deepspeed", "accelerate", "transformers", "peft", "torch.distributed.fsdp",
                  "torch.distributed._composable", "torch.distributed._composable_state")
CORE_MAY_USE = (f"{STRATEGIES}.base", f"{STRATEGIES}.resolver")
# deepspeed_sp.py: how a DeepSpeed engine reduces over the SP ranks, read by the DeepSpeed strategy.
BY_REPOSITORY_NAME = re.compile(r"^\s*(from|import) (tiled_core|strategies)\b", re.MULTILINE)
STRATEGY_SUPPORT = ("__init__.py", "base.py", "registry.py", "resolver.py", "deepspeed_sp.py", "tensor_parallel.py",
                    "hf_tensor_parallel.py", "checked_versions.py")


def imported_modules(source: str, module: str) -> Iterator[Tuple[str, int]]:
    """(absolute module name, line) of every import in ``source``, the file of ``module``."""
    package = module.rsplit(".", 1)[0]  # a module's package; for ``pkg.__init__``, ``pkg`` itself
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # ``from tiled_mlp.strategies import fsdp2`` names a module too
                yield f"{target}.{alias.name}", node.lineno


def within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def package_of(target: str) -> str:
    """Which of the three packages an import target belongs to ('' for none)."""
    for package in (CORE, STRATEGIES, FACADE):  # the facade last: the other two sit beneath its name
        if within(target, package):
            return package
    return ""


def sources(folder: str) -> Iterator[Tuple[Path, str]]:
    """Each file of a repository folder with its installed module name."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = path.relative_to(ROOT / folder).with_suffix("").parts
        yield path, ".".join((INSTALLED[folder],) + parts)


def core_violations(source: str, module: str) -> List[str]:
    found = []
    for target, line in imported_modules(source, module):
        if target.startswith(CORE_FORBIDDEN) or (package_of(target) == FACADE and target != FACADE + ".core"):
            found.append(f"{module}:{line} imports {target}")
        elif within(target, STRATEGIES) and target != STRATEGIES and not target.startswith(CORE_MAY_USE):
            found.append(f"{module}:{line} imports {target}")
        elif target == STRATEGIES:
            found.append(f"{module}:{line} imports the strategies package (every backend module)")
    return found


def package_edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {p: set() for p in (CORE, STRATEGIES, FACADE)}
    for folder, package in INSTALLED.items():
        for path, module in sources(folder):
            for target, _ in imported_modules(path.read_text(), module):
                other = package_of(target)
                if other and other != package:
                    edges[package].add(other)
    return edges


def test_tiled_core_imports_no_backend_and_only_the_strategy_interface():
    found = [v for path, module in sources("tiled_core") for v in core_violations(path.read_text(), module)]
    assert not found, "tiled_core must stay backend-neutral:\n" + "\n".join(found)


def test_the_core_rule_catches_what_it_forbids():
    for bad in ("import deepspeed", "from transformers import LlamaMLP", "from torch.distributed.fsdp import FSDPModule",
                "from tiled_mlp.strategies.fsdp2 import FSDP2Strategy", "from tiled_mlp.strategies import fsdp2",
                "import tiled_mlp", "from tiled_mlp.integrations import hf", "from ..integrations import hf"):
        assert core_violations(bad, "tiled_mlp.core.module"), bad
    for fine in ("import torch", "from tiled_mlp.strategies.base import Strategy",
                 "from tiled_mlp.strategies.resolver import resolve_strategy",
                 "from .shard_plan import ShardPlan", "from ..grad_accum import GradAccumulator"):
        assert not core_violations(fine, "tiled_mlp.core.kernels.generic"), fine


def test_strategies_import_neither_the_core_nor_the_facade():
    found = [f"{module}:{line} imports {target}" for path, module in sources("strategies")
             for target, line in imported_modules(path.read_text(), module)
             if package_of(target) in (CORE, FACADE)]
    assert not found, "\n".join(found)


def test_no_import_cycle_between_the_packages():
    edges = package_edges()
    assert edges[STRATEGIES] == set() and edges[CORE] == {STRATEGIES}, edges

    def reaches(start: str, goal: str, seen: Set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    assert not [p for p in edges if reaches(p, p, set())], edges


def test_each_backend_file_holds_one_strategy():
    for path in sorted((ROOT / "strategies").glob("*.py")):
        if path.name in STRATEGY_SUPPORT:
            continue
        classes = [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                   and any(getattr(base, "id", "") == "Strategy" for base in node.bases)]
        assert len(classes) == 1, f"{path.name}: {classes}"


def test_the_design_cards_top_level():
    for name in ("tiled_core", "strategies", "integration_tests", "tests", "tox.ini", "pyproject.toml", "LICENSE"):
        assert (ROOT / name).exists(), name
    assert not (ROOT / "src").exists()
    # Installed under tiled_mlp by pyproject's package-dir, not linked into it (tests/test_packaging.py).
    for name in ("core", "strategies"):
        assert not (ROOT / "tiled_mlp" / name).exists(), name


def test_nothing_imports_the_folders_by_their_repository_names():
    """``import tiled_core`` would work from the repository root and load every core module a second
    time, beside ``tiled_mlp.core``: two registries, two ``TiledMLP`` classes."""
    found = []
    for folder in ("tiled_core", "strategies", "tiled_mlp", "tests", "integration_tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            for target, line in imported_modules(source, "x.y"):
                if target.split(".")[0] in ("tiled_core", "strategies"):
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            for node in ast.walk(ast.parse(source)):  # code run in a subprocess, written as a string
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and BY_REPOSITORY_NAME.search(node.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} runs code importing a repository name")
    assert not found, "import tiled_mlp.core / tiled_mlp.strategies instead:\n" + "\n".join(found)


def test_importing_the_package_loads_no_module_under_a_repository_name():
    code = "import sys, tiled_mlp; print(sorted(m for m in sys.modules if m.split('.')[0] in ('tiled_core', 'strategies')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    assert out == "[]", out


@pytest.mark.timeout(120)
def test_the_wheel_installs_one_top_level_name(tmp_path):
    # Built from a copy: a build writes build/ and *.egg-info beside the sources.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".tox", ".torch_extensions", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "docs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, env={**os.environ, "PIP_CONSTRAINT": ""})
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tiled_mlp"}, tops
    for module in ("tiled_mlp/core/tiled_call.py", "tiled_mlp/core/kernels/generic.py", "tiled_mlp/strategies/fsdp2.py"):
        assert module in names, module


# Units whose private names stay inside them: the core, the strategies, each facade subpackage, the tests.
UNITS = ("tiled_mlp.core", "tiled_mlp.strategies", "tiled_mlp.integrations", "tiled_mlp.planner", "tiled_mlp.cli",
         "tiled_mlp.bench", "tiled_mlp", "tests", "integration_tests")


def unit_of(module: str) -> str:
    return next((u for u in UNITS if within(module, u)), "")


def private_imports_across_units(source: str, module: str) -> List[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = next(t for t, _ in imported_modules(ast.unparse(node), module))
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            if private and unit_of(target) and unit_of(target) != unit_of(module):
                found.append(f"{module}:{node.lineno} imports {target}.{alias.name}")
    return found


def test_no_private_name_is_imported_across_packages():
    found = [v for folder in (*INSTALLED, "tests", "integration_tests")
             for path, module in (sources(folder) if folder in INSTALLED else
                                  ((p, ".".join((folder,) + p.relative_to(ROOT / folder).with_suffix("").parts))
                                   for p in sorted((ROOT / folder).rglob("*.py"))))
             for v in private_imports_across_units(path.read_text(), module)]
    assert not found, "make the name public where it is defined, or keep its use inside its package:\n" + "\n".join(found)


def test_the_private_import_rule_catches_what_it_forbids():
    assert private_imports_across_units("from tiled_mlp.core.code_forms import _x", "tests.test_a")
    assert private_imports_across_units("from ..core.module import _x", "tiled_mlp.integrations.moe")
    assert not private_imports_across_units("from .module import _x", "tiled_mlp.core.tiled_call")
    assert not private_imports_across_units("from torch.utils._python_dispatch import _x", "tests.test_a")
