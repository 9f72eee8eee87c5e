"""The design card's layout and one-way imports, read from the source (``ast``), so that a change
that breaks them fails here rather than in a review.

- ``tiled_core`` (backend-neutral) imports no backend library (deepspeed, accelerate, transformers,
  peft), no FSDP internals, no backend module of ``strategies`` (only its interface and resolver),
  and not the facade.
- ``strategies`` imports neither ``tiled_core`` nor the facade; each backend file holds one strategy.
- Between the three packages the imports form no cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tiled_core", "strategies", "tiled_mlp")
CORE_FORBIDDEN = ("deepspeed", "accelerate", "transformers", "peft", "torch.distributed.fsdp",
                  "torch.distributed._composable", "torch.distributed._composable_state", "tiled_mlp")
CORE_MAY_USE = ("strategies.base", "strategies.resolver")
# deepspeed_sp.py: how a DeepSpeed engine reduces over the SP ranks, read by the DeepSpeed strategy.
STRATEGY_SUPPORT = ("__init__.py", "base.py", "registry.py", "resolver.py", "deepspeed_sp.py")


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
            for alias in node.names:  # ``from strategies import fsdp2`` names a module too
                yield f"{target}.{alias.name}", node.lineno


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def sources(package: str) -> Iterator[Tuple[Path, str]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, module_name(path)


def core_violations(source: str, module: str) -> List[str]:
    found = []
    for target, line in imported_modules(source, module):
        if target.startswith(CORE_FORBIDDEN) or (
            target.split(".")[0] == "strategies" and target != "strategies" and not target.startswith(CORE_MAY_USE)
        ):
            found.append(f"{module}:{line} imports {target}")
        elif target == "strategies":
            found.append(f"{module}:{line} imports the strategies package (every backend module)")
    return found


def package_edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for path, module in sources(package):
            for target, _ in imported_modules(path.read_text(), module):
                top = target.split(".")[0]
                if top in PACKAGES and top != package:
                    edges[package].add(top)
    return edges


def test_tiled_core_imports_no_backend_and_only_the_strategy_interface():
    found = [v for path, module in sources("tiled_core") for v in core_violations(path.read_text(), module)]
    assert not found, "tiled_core must stay backend-neutral:\n" + "\n".join(found)


def test_the_core_rule_catches_what_it_forbids():
    for bad in ("import deepspeed", "from transformers import LlamaMLP", "from torch.distributed.fsdp import FSDPModule",
                "from strategies.fsdp2 import FSDP2Strategy", "from strategies import fsdp2", "import tiled_mlp"):
        assert core_violations(bad, "tiled_core.module"), bad
    for fine in ("import torch", "from strategies.base import Strategy", "from strategies.resolver import resolve_strategy",
                 "from .shard_plan import ShardPlan", "from ..grad_accum import GradAccumulator"):
        assert not core_violations(fine, "tiled_core.kernels.generic"), fine


def test_strategies_import_neither_the_core_nor_the_facade():
    found = [f"{module}:{line} imports {target}" for path, module in sources("strategies")
             for target, line in imported_modules(path.read_text(), module)
             if target.split(".")[0] in ("tiled_core", "tiled_mlp")]
    assert not found, "\n".join(found)


def test_no_import_cycle_between_the_packages():
    edges = package_edges()
    assert edges["strategies"] == set() and edges["tiled_core"] == {"strategies"}, edges

    def reaches(start: str, goal: str, seen: Set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    assert not [p for p in PACKAGES if reaches(p, p, set())], edges


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
