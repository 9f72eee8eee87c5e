"""docs/gpu.md's measured tables: the store of every row's last measurement and the markdown made from it.

The store (``gpu_report.json`` beside the doc) holds the runs (date, card, driver, versions) and, per
section, each row with the run that measured it. A new run replaces the rows it measured and keeps the
others, which the tables then mark "not measured since <date>, <card>". In the doc, each section's table
lies between two marks (``<!-- gpu-report NAME -->`` ... ``<!-- /gpu-report NAME -->``); the text
around them is the doc's own and is kept as it is.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from .report import markdown_head

STORE = "gpu_report.json"
DOC = "gpu.md"
PLOTS = {"mlp": "gpu_bench.png", "checkpointed": "gpu_checkpointed.png"}
MiB = 2**20
GiB = 2**30
# Where a table's columns come from, in this order (a column shows where some row has that implementation).
MLP_COLUMNS = {"auto": "ours, auto", "fast": "fast, Liger's SiLU-mul", "fast_native_act": "fast, native SiLU-mul",
               "deepspeed": "DeepSpeed's TiledMLP", "liger": "Liger's LigerTiledSwiGLUMLP"}
CHECKPOINTED_COLUMNS = {"ours": "ours", "deepspeed": "DeepSpeed's TiledMLP"}
REGION_NAMES = {"mlp-half": "MLP half (RMSNorm, MLP, residual)", "llama-layer": "HF Llama decoder layer (sdpa attention)"}
VERSIONS = ("torch", "transformers", "deepspeed", "liger-kernel", "triton")


def empty_store() -> dict:
    return {"runs": {}, "sections": {}}


def load_store(folder: str) -> dict:
    path = os.path.join(folder, STORE)
    if not os.path.exists(path):
        return empty_store()
    with open(path) as f:
        store = json.load(f)
    if not (isinstance(store, dict) and isinstance(store.get("runs"), dict) and isinstance(store.get("sections"), dict)):
        raise ValueError(f"{path} is not a gpu-report store (a JSON object with 'runs' and 'sections')")
    return store


def merge(store: dict, run_id: str, run: dict, measured: Dict[str, Dict[str, dict]]) -> dict:
    """``store`` with ``run`` added and each measured row (section -> key -> row) replacing its key's."""
    out = json.loads(json.dumps(store))
    out["runs"][run_id] = run
    for section, rows in measured.items():
        table = out["sections"].setdefault(section, {})
        for key, row in rows.items():
            table[key] = dict(row, run=run_id)
    return out


# -- stamps ---------------------------------------------------------------------------------------------
def _run_line(run: dict) -> str:
    versions = ", ".join(f"{name} {run['versions'][name]}" for name in VERSIONS if run.get("versions", {}).get(name))
    driver = f", driver {run['driver']}" if run.get("driver") else ""
    return f"Measured {run['date']} on one {run['card']}{driver}: {versions or 'versions not recorded'}."


def _stamp(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    """The top of a table: each run its rows come from (the newest first)."""
    ids = sorted({r["run"] for r in rows}, key=lambda i: runs[i]["date"], reverse=True)
    lines = [_run_line(runs[i]) for i in ids]
    if current is not None and current not in ids:
        lines.append(f"Not measured in the run of {runs[current]['date']} on {runs[current]['card']}.")
    return "\n".join(f"_{line}_" for line in lines)


def _mark(row: dict, runs: dict, current: Optional[str]) -> str:
    """'' for a row this run measured; else 'not measured since <date>, <card>'."""
    if row["run"] == current:
        return ""
    run = runs[row["run"]]
    return f" (not measured since {run['date']}, {run['card']})"


def _ratio(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# -- the tables -----------------------------------------------------------------------------------------
def mlp_table(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    impls = [i for i in MLP_COLUMNS if any(i in r["cells"] for r in rows)]
    head = ["tokens", "untiled"] + [f"{MLP_COLUMNS[i]} (shards: memory, time)" for i in impls]
    lines = markdown_head(head)
    for r in sorted(rows, key=lambda r: r["seq"]):
        base = r["cells"]["untiled"]
        line = [f"{r['seq']}{_mark(r, runs, current)}", f"{base['peak_mb']:.1f} MiB, {base['ms']:.2f} ms"]
        for impl in impls:
            c = r["cells"].get(impl)
            if c is None:
                line.append("-")
                continue
            shards = "passes through" if impl == "auto" and c["num_shards"] == 1 else str(c["num_shards"])
            line.append(f"{shards}: {_ratio(c['mem_ratio'])}, {_ratio(c['time_ratio'])}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def checkpointed_table(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    impls = [i for i in CHECKPOINTED_COLUMNS if any(i in r["cells"] for r in rows)]
    head = ["region (one non-reentrant checkpoint)", "untiled"] + [CHECKPOINTED_COLUMNS[i] for i in impls]
    lines = markdown_head(head)
    order = list(REGION_NAMES)
    for r in sorted(rows, key=lambda r: order.index(r["region"]) if r["region"] in order else len(order)):
        base = r["cells"]["untiled"]
        line = [f"{REGION_NAMES.get(r['region'], r['region'])}, {r['seq']} tokens{_mark(r, runs, current)}",
                f"{base['mlp_forwards']:.0f} forwards, {base['ms']:.1f} ms, {base['peak_mb']:.1f} MiB"]
        for impl in impls:
            c = r["cells"].get(impl)
            line.append("-" if c is None else f"{c['shards']} shards, {c['mlp_forwards']:.0f} forwards, "
                        f"{c['ms'] / base['ms']:.3f}, {c['peak_mb'] / base['peak_mb']:.3f}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def loss_table(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    config = rows[0]["config"]
    t, m = config["time_size"], config["memory_size"]
    head = ["method", f"time at {t[0]} x {t[1]} x {t[2]} ({config.get('time_dtype', 'float32')}), vs untiled",
            "allocator peak there", f"modelled peak at {m[0]} x {m[1]} x {m[2]} ({config['memory_dtype']})",
            "dx, dW error vs untiled (float32)"]
    lines = markdown_head(head)
    for r in rows:
        time_cell = r.get("time_note") or (f"{r['seconds'] * 1e3:.1f} ms, {r['time_ratio']:.3f}"
                                           if r.get("seconds") is not None else "-")
        device_peak = r.get("device_peak_bytes")
        modelled = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / GiB:.2f} GiB"
        errors = r.get("errors") or {}
        lines.append(f"| {r['label']}{_mark(r, runs, current)} | {time_cell} | "
                     f"{'-' if device_peak is None else f'{device_peak / GiB:.2f} GiB'} | {modelled} | "
                     f"{errors.get('dx', 0):.1e}, {errors.get('dW', 0):.1e} |")
    skipped = rows[0].get("skipped") or {}
    lines += [f"\nNot run: {name}, {why}." for name, why in skipped.items()]
    return "\n".join(lines)


def compiled_table(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    head = ["size (tokens x hidden x intermediate)", "shards", "compiled untiled", "eager tiled", "compiled tiled",
            "compiled tiled / compiled untiled (target 1.20)", "compiled tiled / eager tiled (target 1.00)",
            "peaks (MiB): compiled untiled, eager tiled, compiled tiled", "graphs, breaks"]
    lines = markdown_head(head)
    for r in sorted(rows, key=lambda r: (r["seq"], r["hidden"])):
        v = r["variants"]
        checks = r["time"]
        explain = r.get("explain") or {}
        note = f"; {r['note']}" if r.get("note") else ""
        ratios = [f"{checks[k]['ratio']:.3f} ({'met' if checks[k]['ratio'] <= checks[k]['target'] else 'missed'})"
                  for k in ("compiled_tiled/compiled_untiled", "compiled_tiled/eager_tiled")]
        lines.append(f"| {r['seq']} x {r['hidden']} x {r['intermediate']}{_mark(r, runs, current)}{note} | "
                     f"{r['memory']['num_shards']} | {v['compiled_untiled']['ms']:.2f} ms | {v['eager_tiled']['ms']:.2f} ms | "
                     f"{v['compiled_tiled']['ms']:.2f} ms | {ratios[0]} | {ratios[1]} | "
                     f"{v['compiled_untiled']['peak_mb']:.1f}, {v['eager_tiled']['peak_mb']:.1f}, "
                     f"{v['compiled_tiled']['peak_mb']:.1f} | "
                     f"{explain.get('graph_count', '-')}, {explain.get('graph_break_count', '-')} |")
    return "\n".join(lines)


def planner_table(rows: List[dict], runs: dict, current: Optional[str]) -> str:
    head = ["tokens", "setting", "modelled", "modelled attention workspace", "tracked on the device",
            "allocator", "allocator / modelled (target 1.03)"]
    lines = markdown_head(head)
    for r in sorted(rows, key=lambda r: (r["seq"], r["setting"] != "untiled+ckpt")):
        extra = r["tracked_minus_modelled_bytes"]
        tracked = "equal" if extra == 0 else f"{extra:+d} bytes"
        workspace = "not modelled" if r.get("workspace_gib") is None else f"{r['workspace_gib']:.3f} GiB"
        longest = (f", the longest modelled to fit {r['device_gib']:.0f} GiB (cap {r['cap']})"
                   if r.get("longest") else "")
        lines.append(f"| {r['seq']}{longest}{_mark(r, runs, current)} | {r['setting']} | {r['modelled_gib']:.3f} GiB | "
                     f"{workspace} | {tracked} | {r['allocator_gib']:.3f} GiB | {r['allocator_over_modelled']:.4g} |")
    return "\n".join(lines)


TABLES = {"mlp": mlp_table, "checkpointed": checkpointed_table, "loss": loss_table, "compiled": compiled_table,
          "planner": planner_table}


def render_section(name: str, store: dict, current: Optional[str]) -> str:
    rows = list(store["sections"].get(name, {}).values())
    if not rows:
        return "_Not measured on a GPU yet: `tiled-mlp gpu-report --sections " + name + "`._"
    block = _stamp(rows, store["runs"], current) + "\n\n" + TABLES[name](rows, store["runs"], current)
    if name in PLOTS:
        block += f"\n\n![{name} on the GPU]({PLOTS[name]})"
    return block


# -- the doc --------------------------------------------------------------------------------------------
def _marks(name: str):
    return f"<!-- gpu-report {name} -->", f"<!-- /gpu-report {name} -->"


def update_doc(text: str, blocks: Dict[str, str], titles: Dict[str, str]) -> str:
    """``text`` with each block between its marks; a section without marks is added at the end under its title."""
    for name, block in blocks.items():
        start, end = _marks(name)
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
        replacement = f"{start}\n{block}\n{end}"
        found = pattern.search(text)
        if found:  # sliced, not re.sub: a block's backslashes stay as they are
            text = text[:found.start()] + replacement + text[found.end():]
        else:
            text = text.rstrip("\n") + f"\n\n## {titles.get(name, name)}\n\n{replacement}\n"
    return text


def write(folder: str, store: dict, current: Optional[str], titles: Dict[str, str]) -> List[str]:
    """Writes the store and the doc's tables into ``folder``; the paths written."""
    doc = os.path.join(folder, DOC)
    text = open(doc).read() if os.path.exists(doc) else "# GPU measurements\n"
    blocks = {name: render_section(name, store, current) for name in TABLES}
    with open(doc, "w") as f:
        f.write(update_doc(text, blocks, titles))
    with open(os.path.join(folder, STORE), "w") as f:
        json.dump(store, f, indent=1, sort_keys=True)
        f.write("\n")
    return [doc, os.path.join(folder, STORE)]


def plot(folder: str, store: dict, current: str) -> List[str]:
    """The plots of the sections this run measured (matplotlib): the paths written."""
    from .checkpointed import plot_rows
    from .report import plot as plot_mlp

    written = []
    run = store["runs"][current]
    mlp = [c for r in store["sections"].get("mlp", {}).values() if r["run"] == current for c in r["cells"].values()]
    if mlp:
        path = os.path.join(folder, PLOTS["mlp"])
        plot_mlp(sorted(mlp, key=lambda c: c["seq"]), path, f"SwiGLU 4096/12288 bf16 on {run['card']}, {run['date']}")
        written.append(path)
    checkpointed = [c for r in store["sections"].get("checkpointed", {}).values() if r["run"] == current
                    for c in r["cells"].values()]
    if checkpointed:
        path = os.path.join(folder, PLOTS["checkpointed"])
        plot_rows(checkpointed, path, f"{run['card']} bf16, {run['date']}")
        written.append(path)
    return written
