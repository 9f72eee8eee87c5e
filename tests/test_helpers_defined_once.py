"""Every helper of the test suite is defined once: a function or class name is defined at module level
in at most one file of tests/ and integration_tests/. Tests import shared helpers (tiny models,
batches, references) from their one home instead of carrying a copy that drifts from the others."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tests", "integration_tests")

# pytest collects tests by this prefix: each file's tests are its own, never imported by another.
TEST_PREFIX = "test_"
# A fixture in a test file reaches that file's tests only, by its parameter name (``ranks``: this file's spawned
# ranks); one that several files need belongs in conftest.py, not in a helper module.

# Names still defined in more than one file, each with the files allowed to hold it. These files are
# rewritten on other branches this session (the fast-path proof, call plan, compile, kernel and strategy
# tests); the entry goes when they import the shared helper or rename theirs. An entry that no longer
# matches a duplicate fails the stale-entry test below, so the list only shrinks.
PENDING: Dict[str, Set[str]] = {}


def _is_fixture(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any("fixture" in ast.unparse(decorator) for decorator in decorators)


def module_level_names() -> Dict[str, List[str]]:
    """Name -> the files (relative to the repository) defining it at module level, a test file's fixtures
    left out."""
    where: Dict[str, List[str]] = defaultdict(list)
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in tree.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                if path.name.startswith(TEST_PREFIX) and _is_fixture(node):
                    continue
                where[node.name].append(path.relative_to(ROOT).as_posix())
    return where


def duplicates() -> Dict[str, List[str]]:
    return {name: files for name, files in module_level_names().items()
            if len(files) > 1 and not name.startswith(TEST_PREFIX)}


def test_no_helper_is_defined_in_two_test_files():
    offending = {name: files for name, files in duplicates().items()
                 if not set(files) <= PENDING.get(name, set())}
    listing = "\n".join(f"  {name}: {', '.join(files)}" for name, files in sorted(offending.items()))
    assert not offending, (
        f"{len(offending)} helper names are defined in more than one test file; define each once "
        f"(integration_tests/tiny_models.py, toy_models.py, comparison.py; tests/reference.py, loss_reference.py, "
        f"planner_checks.py) and import it, or give "
        f"helpers that differ names that say how:\n{listing}")


def test_pending_entries_are_still_needed():
    found = duplicates()
    stale = {name: sorted(files - set(found.get(name, ()))) for name, files in PENDING.items()}
    stale = {name: files for name, files in stale.items() if files}
    assert not stale, f"PENDING lists files that no longer hold a duplicate of the name; remove them: {stale}"
