"""REPORT.md's main table: each row's measured lines by class and statements, and the tests that name it."""
from __future__ import annotations

from collections import Counter

from features import ROWS
from table import COLUMNS, rows
from tests_per_row import per_row

if __name__ == "__main__":
    data, naming, dedicated = rows(), per_row(), per_row(dedicated=True)
    head = ["#", "row", *COLUMNS, "tests naming it (files/tests)", "dedicated test files (files/tests)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * 2 + "---:|" * len(COLUMNS) + "---:|---:|")
    total = Counter()
    for i, key in enumerate(ROWS, start=1):
        c = data[key]
        total += c
        n, t, _ = naming[key]
        dn, dt, _ = dedicated[key]
        print(f"| {i} | {key} | " + " | ".join(str(c[k]) for k in COLUMNS) + f" | {n}/{t} | {dn}/{dt} |")
    print("| | **total** | " + " | ".join(f"**{total[k]}**" for k in COLUMNS) + " | | |")
