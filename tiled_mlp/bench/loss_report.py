"""``bench-loss`` results as the printed table (with its reference figures and notes) and a PNG."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .report import markdown_head

GiB = 2**30


def _num(value: Optional[float], fmt: str, missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def _size(size) -> str:
    tokens, hidden, vocab = size
    return f"{tokens} tokens x hidden {hidden} x vocab {vocab}"


def _row(row: Dict[str, Any], floor: int) -> str:
    shards = row["shards"]
    peak = row["peak_bytes"]
    errors = row["errors"]
    cells = [row["label"], f"{shards['memory']} / {shards['time']} / {shards['accuracy']}",
             "not measurable" if peak is None else f"{peak / GiB:.3f}",
             "-" if peak is None else f"{peak / floor:.3f}",
             _num(row["seconds"], ".2f", row["time_note"] or "-"), _num(row["time_ratio"], ".3f"),
             f"{errors['loss']:.1e}", f"{errors['dx']:.1e}", f"{errors['dW']:.1e}"]
    return "| " + " | ".join(cells) + " |"


def format_report(result: Dict[str, Any]) -> str:
    cfg, ref = result["config"], result["reference"]
    rows: List[Dict[str, Any]] = result["rows"]
    floor = ref["floor_bytes"]
    head = ["method", "shards (memory / time / accuracy)", "peak GiB", "peak / floor", "CPU s (median)",
            "time vs untiled", "loss rel err", "dx rel err", "dW rel err"]
    lines = [
        f"memory: exact peak with fake tensors, {cfg['memory_dtype']}, {_size(cfg['memory_size'])}, batch 1 "
        "(x, dx, W, dW and labels counted)",
        f"time: CPU fp32, {_size(cfg['time_size'])}, forward+backward, median of {cfg['rounds']} interleaved rounds "
        "after a warm-up round",
        f"gradient error: fp32, {_size(cfg['accuracy_size'])}, relative to the untiled loss in the same run "
        f"(DeepSpeed at {cfg['deepspeed_accuracy_shards']} shards, ArcticTraining's pattern)",
        "",
        *markdown_head(head),
    ]
    lines += [_row(row, floor) for row in rows]
    lines += [
        "",
        f"floor x + dx + W + dW: {floor / GiB:.3f} GiB",
        f"floor + one shard's fp32 logits and their fp32 gradient ({ref['shard_tokens']} tokens a shard): "
        f"{ref['floor_plus_shard_bytes'] / GiB:.3f} GiB",
    ]
    lines += _notes(result)
    return "\n".join(lines)


def _notes(result: Dict[str, Any]) -> List[str]:
    rows = result["rows"]
    notes = ["", "largest buffers alive at each peak (x, W, labels named; others by dtype[shape]):"]
    for row in rows:
        if row["peak_bytes"] is not None:
            parts = [f"{b['what']} {b['bytes'] / GiB:.3f} GiB" + (f" x{b['count']}" if b["count"] > 1 else "")
                     for b in row["largest_at_peak"]]
            notes.append(f"- {row['method']}: " + ", ".join(parts))
    answered = [row for row in rows if row["answered"]]
    if answered:
        notes += ["", "branches on tensor values, answered False under fake tensors (loss_peak_tracker.py: why the "
                  "peak does not depend on these):"]
        for row in answered:
            sites = sorted(set(row["answered"]))
            notes.append(f"- {row['method']}: {len(row['answered'])} x " + "; ".join(sites))
    failed = [row for row in rows if row["peak_error"]]
    if failed:
        notes += ["", "not measurable with fake tensors:"]
        notes += [f"- {row['method']}: {row['peak_error']}" for row in failed]
    ds = next((row for row in rows if row["method"] == "deepspeed"), None)
    if ds is not None:
        notes += ["", f"DeepSpeed's dW relative error {ds['errors']['dW']:.4g} = N - 1 for N valid tokens: "
                  "TiledFusedLogitsLoss accumulates dW in forward with an incoming gradient of 1 and scales only dx "
                  "in backward, so ArcticTraining's 'sum, then divide by N' leaves dW N times too large."]
    for method, reason in result["skipped"].items():
        notes += ["", f"skipped {method}: {reason}"]
    return notes


def plot_report(result: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ref = result["rows"], result["reference"]
    names = [row["method"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = [f"C{i}" for i in range(len(rows))]

    peaks = [row["peak_bytes"] / GiB if row["peak_bytes"] is not None else 0 for row in rows]
    bars = axes[0].bar(names, peaks, color=colors)
    axes[0].bar_label(bars, labels=["n/m" if row["peak_bytes"] is None else f"{p:.2f}" for row, p in zip(rows, peaks, strict=True)],
                      fontsize=7)
    axes[0].axhline(ref["floor_bytes"] / GiB, color="gray", ls="--", lw=0.8, label="floor x+dx+W+dW")
    axes[0].axhline(1.05 * ref["floor_plus_shard_bytes"] / GiB, color="green", ls=":", lw=1,
                    label="1.05 x (floor + one shard's fp32 logits + grad)")
    axes[0].set_yscale("log")
    axes[0].set_title(f"peak memory, GiB ({_size(result['config']['memory_size'])}, fake tensors)", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))

    ratios = [row["time_ratio"] or 0 for row in rows]
    bars = axes[1].bar(names, ratios, color=colors)
    axes[1].bar_label(bars, labels=["= ours" if row["time_note"] else "-" if row["time_ratio"] is None else f"{row['time_ratio']:.3f}"
                                    for row in rows], fontsize=7)
    axes[1].axhline(1.0, color="gray", ls="--", lw=0.8)
    axes[1].axhline(1.05, color="green", ls=":", lw=1, label="1.05 x untiled")
    axes[1].set_title(f"CPU fwd+bwd time / untiled ({_size(result['config']['time_size'])})", fontsize=9)
    axes[1].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))

    dw = [max(row["errors"]["dW"], 1e-12) for row in rows]  # the reference's own 0 drawn at the axis floor
    bars = axes[2].bar(names, dw, color=colors)
    axes[2].bar_label(bars, labels=["reference" if row["method"] == "untiled" else f"{row['errors']['dW']:.1e}"
                                    for row in rows], fontsize=7)
    axes[2].set_yscale("log")
    axes[2].set_title("dW relative error vs untiled (fp32; DeepSpeed: ArcticTraining's sum / N)", fontsize=9)

    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle("causal-LM loss + backward: untiled vs torch chunked vs DeepSpeed vs tiled_cross_entropy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
