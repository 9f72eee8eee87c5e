"""Turns benchmark rows into the seed-style table, JSON, and a PNG plot."""
from __future__ import annotations

import json
from typing import Dict, List, Optional


def markdown_head(head: List[str]) -> List[str]:
    """A markdown table's header and rule lines for the columns ``head``."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def _by_seq(rows: List[dict]) -> Dict[int, Dict[str, dict]]:
    table: Dict[int, Dict[str, dict]] = {}
    for row in rows:
        table.setdefault(row["seq"], {})[row["impl"]] = row
    return table


def _pct(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{(ratio - 1) * 100:+.1f}%"


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: List[dict], tiled: str = "auto") -> str:
    """Seed-style markdown table: ours (``tiled``) against untiled, then each other implementation."""
    table = _by_seq(rows)
    impls = [i for i in dict.fromkeys(r["impl"] for r in rows) if i not in ("untiled", tiled)]
    head = ["seq", "untiled ms", f"{tiled} ms", "time change", "untiled MB", f"{tiled} MB", "memory change",
            f"{tiled} shards", f"{tiled} grad err"]
    for impl in impls:
        head += [f"{impl} ms", f"{impl} MB", f"{impl} shards"]
    lines = markdown_head(head)
    for seq, cells in table.items():
        base, ours = cells["untiled"], cells.get(tiled)
        if ours is None:
            continue
        line = [str(seq), _num(base["ms"], ".1f"), _num(ours["ms"], ".1f"), _pct(ours["time_ratio"]),
                f"{base['peak_mb']:.1f}", f"{ours['peak_mb']:.1f}", _pct(ours["mem_ratio"]), str(ours["num_shards"]),
                _num(ours["grad_rel_err"], ".1e")]
        for impl in impls:
            cell = cells.get(impl)
            line += ["-", "-", "-"] if cell is None else [_num(cell["ms"], ".1f"), f"{cell['peak_mb']:.1f}", str(cell["num_shards"])]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def to_json(rows: List[dict], config: dict) -> str:
    return json.dumps({"config": config, "rows": rows}, indent=2)


def plot(rows: List[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(r["ms"] is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4), squeeze=False)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    panels = [("peak_mb", "peak memory (MiB)")] + ([("ms", "fwd+bwd time (ms)")] if timed else [])
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for impl in impls:
            pts = [(r["seq"], r[key]) for r in rows if r["impl"] == impl and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
