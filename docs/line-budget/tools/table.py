"""Per-feature line counts (tools/features.py's map over tools/measure.py's classes), checked to cover every line
of the counted library once. Run from anywhere: ``python tools/table.py [--markdown]``."""
from __future__ import annotations

import sys
from collections import Counter, defaultdict

from features import ROWS
from measure import classify, library_files

COLUMNS = ("lines", "blank", "docstring", "comment", "message", "text", "code", "statements")


def line_owner() -> dict:
    """(path, line) -> row key; raises where a line is unowned or owned twice."""
    sizes = {f: len(classify(f)[0]) for f in library_files()}
    owner: dict = {}
    for key, (_, parts) in ROWS.items():
        for part in parts:
            path, a, b = (part, 1, sizes.get(part, 0)) if isinstance(part, str) else part
            if path not in sizes:
                raise SystemExit(f"{key}: {path} is not a library file")
            for i in range(a, b + 1):
                if i > sizes[path]:
                    raise SystemExit(f"{key}: {path} has no line {i}")
                if (path, i) in owner:
                    raise SystemExit(f"{path}:{i} is in both {owner[(path, i)]} and {key}")
                owner[(path, i)] = key
    missing = [(f, i) for f, n in sizes.items() for i in range(1, n + 1) if (f, i) not in owner]
    if missing:
        raise SystemExit(f"{len(missing)} lines in no row, first: {missing[:10]}")
    return owner


def rows() -> dict:
    owner = line_owner()
    out: dict = defaultdict(Counter)
    for f in library_files():
        kinds, _, stmt_lines = classify(f)
        for i, kind in enumerate(kinds, start=1):
            c = out[owner[(f, i)]]
            c[kind] += 1
            c["lines"] += 1
        for line in stmt_lines:
            out[owner[(f, line)]]["statements"] += 1
    return out


if __name__ == "__main__":
    md = "--markdown" in sys.argv
    data = rows()
    total = Counter()
    if md:
        print("| row | feature | " + " | ".join(COLUMNS) + " |")
        print("|---|---|" + "---:|" * len(COLUMNS))
    for key, (title, _) in ROWS.items():
        c = data[key]
        total += c
        if md:
            print(f"| {key} | {title} | " + " | ".join(str(c[k]) for k in COLUMNS) + " |")
        else:
            print(f"{key:16}" + "".join(f"{c[k]:7}" for k in COLUMNS))
    if md:
        print("| **total** | | " + " | ".join(f"**{total[k]}**" for k in COLUMNS) + " |")
    else:
        print(f"{'TOTAL':16}" + "".join(f"{total[k]:7}" for k in COLUMNS))
        print(f"{'':16}" + "".join(f"{k[:6]:>7}" for k in COLUMNS))
