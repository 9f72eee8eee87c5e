"""Print each library file's top-level definitions with their line ranges (an aid for tools/features.py)."""
import ast
import sys
from pathlib import Path

from measure import library_files

for path in (sys.argv[1:] or library_files()):
    src = Path(path).read_text()
    tree = ast.parse(src)
    doc = ast.get_docstring(tree) or ""
    print(f"== {path} ({len(src.splitlines())}) {doc.splitlines()[0] if doc else ''}")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            print(f"   {start}-{node.end_lineno} {type(node).__name__[:5]} {node.name}")
