"""What a rank holds against sequence length (the total ``fits`` judges), one line per setting, with
the budget and each setting's longest sequence marked."""
from __future__ import annotations

from typing import Dict, List, Optional

from .plan import Point

GiB = 2**30


def plot_plan(points: List[Point], max_seq: Dict[str, int], budget: Optional[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    settings = list(dict.fromkeys(p.setting for p in points))
    for index, setting in enumerate(settings):
        mine = sorted((p for p in points if p.setting == setting), key=lambda p: p.seq)
        color = f"C{index}"
        ax.plot([p.seq for p in mine], [p.held_bytes / GiB for p in mine], "o-", color=color,
                label=f"{setting} (max {max_seq[setting]:,} tokens)" if setting in max_seq else setting, markersize=3)
        if max_seq.get(setting):
            ax.axvline(max_seq[setting], color=color, linestyle=":", linewidth=1)
    if budget is not None:
        ax.axhline(budget / GiB, color="black", linestyle="--", linewidth=1, label=f"budget {budget / GiB:.0f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("held per rank: step peak + optimizer on the device (GiB)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
