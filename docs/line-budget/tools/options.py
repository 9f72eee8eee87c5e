"""Scope options: each row's lines kept (measured rows, with a simplified or refusing form's size where the
option simplifies a row: those sizes are ESTIMATES, their basis in REPORT.md and tools/subsets.py)."""
from __future__ import annotations

from features import ROWS
from table import rows

BUDGET = 6500

# Estimated size of each row's simplified form (lines, all classes included); 0 = removed.
SIMPLIFIED = {
    "plan": 100,        # MapPlan + call_config + current_plan (72, measured) + ~30 lines of one identity tuple
    "auto": 90,         # auto_decision + shard_count + saved bytes + sizes (83, measured) + glue
    "guards": 120,      # TensorReads' foreign-read discovery (~80 of its 120) + buffer_guard.py (37)
    "strict": 10,       # only: refuse a call while parametrize.cached() is on
    "fused": 0,         # the native activation always
    "fastproof": 430,   # bytecode proof kept, gated_forms' extension registries dropped (-152 of its 203)
    "kernelapi": 150,   # kernels/base.py (109) + a fixed-order choice (~40)
    "compile": 15,      # torch.compiler.disable around the tiled call and the loss: one graph break each
    "stratapi": 150,    # capabilities + Strategy (102) + a fixed resolver over the built-ins (~50)
    "tp": 25,           # refuse DTensor parameters / tensor-parallel hooks, naming the fix
    "autotp": 10,       # refuse AutoTP's linear classes
    "wrappers": 80,     # TRL's fused head seen and left the loss (59, measured) + refuse any other instance forward
    "smoothing": 12,    # the one-time warning that the Trainer's smoother bypasses the tiled loss
    "norms": 70,        # norms=True on the generic kernel: integrations/norms.py (63) + glue
    "report": 30,       # a list of (name, kind, path) and the skipped
    "flags": 224,       # args + stack kept; enable_tiled_mlp/from_config/from_pretrained (59) dropped
    "ulysses": 0, "sp_loss": 0, "offload": 0, "hfloss": 0,
    "axolotl": 0, "llamafactory": 0, "msswift": 0, "framework_common": 0,
}

ENTRY = ["axolotl", "llamafactory", "msswift", "framework_common"]
# Each option: the rows it changes, as a key (its SIMPLIFIED size) or "key=lines" (this option's own size).
OPTIONS = {
    "A. Data-parallel scope: no sequence or tensor parallelism":
        ["ulysses", "sp_loss", "tp", "autotp", "strict", "fused", "smoothing", "report", "plan", "guards", "auto",
         "kernelapi", "stratapi", "wrappers", "fastproof", "flags", "norms"],
    "B. The long-context stack, eager, on data-parallel backends + Ulysses, no framework plugins":
        ["tp", "autotp", "compile", "strict", "fused", "smoothing", "report=0", "auto=20", "kernelapi", "stratapi",
         "fastproof", "wrappers", "plan", "guards", "norms", "flags", *ENTRY],
    "C. A tiled-MLP library: no Hugging Face training stack":
        ["ulysses", "sp_loss", "offload", "hfloss", "wrappers=0", "smoothing=0", "flags=0", "strict", "report",
         "stratapi", "kernelapi", "fused", "plan", "guards", *ENTRY],
    "D. Every feature kept, every row simplified (does not reach the budget)":
        ["plan", "auto", "guards", "strict", "fused", "fastproof", "kernelapi", "compile", "stratapi", "autotp",
         "wrappers", "smoothing", "norms", "report", "flags"],
}
# Lines that go with a removed row but sit in another row (the compile route of the HF loss forward).
ALSO_GONE = {"hfloss": {"compile": 41}}


def parse(changed):
    out = {}
    for item in changed:
        key, _, size = item.partition("=")
        out[key] = int(size) if size else SIMPLIFIED[key]
    return out


def evaluate(changed):
    data = rows()
    kept = {key: data[key]["lines"] for key in ROWS}
    sizes = parse(changed)
    for key, size in sizes.items():
        kept[key] = min(kept[key], size)
    for key in sizes:
        for other, lines in ALSO_GONE.get(key, {}).items():
            if other not in changed:
                kept[other] -= lines
    return kept


if __name__ == "__main__":
    base = {k: v["lines"] for k, v in rows().items()}
    for name, changed in OPTIONS.items():
        kept = evaluate(changed)
        total = sum(kept.values())
        print(f"{total:6}  ({total - BUDGET:+5} vs {BUDGET})  {name}")
        for key in parse(changed):
            print(f"        {key:16} {base[key]:5} -> {kept[key]:5}")


def tests_that_go(changed) -> tuple:
    """The dedicated test files (tests_per_row.DEDICATED) of the rows an option removes or reduces to a refusal
    (25 lines or fewer): files, and the tests collected in them."""
    from tests_per_row import collected, per_row

    counts, dedicated = collected(), per_row(dedicated=True)
    files = sorted({f for key, size in parse(changed).items() if size <= 25 for f in dedicated[key][2]})
    return len(files), sum(counts.get(f, 0) for f in files)


if __name__ == "__main__":
    for name, changed in OPTIONS.items():
        n, t = tests_that_go(changed)
        print(f"{name[:2]} dedicated test files of rows removed or refused: {n} files, {t} tests")
