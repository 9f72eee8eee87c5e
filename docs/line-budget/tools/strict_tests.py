"""The test functions that run in strict mode: in a file whose ``strict`` fixture is autouse, taking the ``strict``
fixture, marked ``usefixtures("strict")``, or naming ``strict_mode``/``TILED_MLP_STRICT`` in their body
(``tests/test_module_tree.py``'s tests, parametrized over both modes, count only where they name it)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository

if __name__ == "__main__":
    total = 0
    for path in sorted([*ROOT.glob("tests/test_*.py"), *ROOT.glob("integration_tests/test_*.py")]):
        src = path.read_text()
        if "strict_mode" not in src and "TILED_MLP_STRICT" not in src:
            continue
        autouse = re.search(r"fixture\(autouse=True\)\s*\ndef strict", src) is not None
        n = 0
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = ast.get_source_segment(src, node) or ""
                decorators = "".join(ast.get_source_segment(src, d) or "" for d in node.decorator_list)
                if (autouse or "strict" in [a.arg for a in node.args.args] or '"strict"' in decorators
                        or "strict_mode" in body or "TILED_MLP_STRICT" in body):
                    n += 1
        total += n
        print(f"{n:3}  {path.relative_to(ROOT)}{'  (autouse)' if autouse else ''}")
    print(f"{total:3}  test functions in strict mode")
