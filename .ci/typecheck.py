"""mypy over the package as it is installed: ``tiled_core/`` as ``tiled_mlp.core`` and ``strategies/`` as
``tiled_mlp.strategies`` (pyproject's ``package-dir``), which mypy cannot find by itself (it maps modules to
folders by name). Each file is given to mypy with its installed module name; errors name the repository's
files. The options are pyproject's ``[tool.mypy]``: ``python .ci/typecheck.py``."""
import os
import sys
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.find_sources import BuildSource
from mypy.main import process_options

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = {"tiled_mlp": "tiled_mlp", "tiled_core": "tiled_mlp.core", "strategies": "tiled_mlp.strategies"}


def sources() -> list:
    found = []
    for folder, package in INSTALLED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join((package,) + (parts[:-1] if parts[-1] == "__init__" else parts))
            found.append(BuildSource(str(path.relative_to(ROOT)), module))
    return found


def main() -> int:
    os.chdir(ROOT)
    _, options = process_options(["--config-file", "pyproject.toml"])
    given = sources()
    try:
        errors = build.build(given, options).errors
    except CompileError as error:
        errors = error.messages
    print("\n".join(errors + [f"Found {len(errors)} errors" if errors else "Success: no issues found"])
          + f" in {len(given)} source files")
    return 1 if errors else 0

if __name__ == "__main__":
    sys.exit(main())
