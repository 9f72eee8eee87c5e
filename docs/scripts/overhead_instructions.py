"""Instructions a warm tiled call executes over the bare autograd Function (``tiled-mlp bench-overhead``'s two
functions, 4 shards), counted by callgrind: a loaded machine does not move the count (docs/architecture.md,
"Budgets (measured)").

    python docs/scripts/overhead_instructions.py [--calls 100] [--pairs 3] [--processes 2]

Each process (run under valgrind) warms both functions, then counts ``--calls`` calls of each, interleaved
``--pairs`` times (``callgrind_control`` switches counting on around the calls and dumps each block); the
answer is the mean of every pair's difference per call, with the range. Processes differ by a few thousand
instructions (memory layout), so compare two commits with the same number of processes in the same sitting.
Put a checkout first on PYTHONPATH to measure it (a script run by path otherwise imports the installed package).
"""
import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import tempfile

FUNCTIONS = {"tiled": "tiled forward+backward (4 shards)", "bare": "bare Function forward+backward (4 shards)"}


def _measure_here(calls: int, pairs: int) -> None:
    """Inside valgrind: the blocks, each dumped under its function's name."""
    import tiled_mlp.bench.overhead as overhead

    captured = {}

    def keep(fns, calls, blocks=9):  # the bench's own functions, built as it builds them, not timed
        captured.update(fns)
        return {name: 1.0 for name in fns}

    overhead.per_call_us = keep
    overhead.measure(calls=10)
    pid = str(os.getpid())
    for _ in range(50):
        for name in FUNCTIONS.values():
            captured[name]()
    for _ in range(pairs):
        for which, name in FUNCTIONS.items():
            fn = captured[name]
            subprocess.run(["callgrind_control", "-z", pid], capture_output=True, check=False)
            subprocess.run(["callgrind_control", "-i", "on", pid], capture_output=True, check=False)
            for _ in range(calls):
                fn()
            subprocess.run(["callgrind_control", "-i", "off", pid], capture_output=True, check=False)
            subprocess.run(["callgrind_control", "-d", which, pid], capture_output=True, check=False)


def _process(calls: int, pairs: int, out_dir: str, index: int) -> list:
    out = os.path.join(out_dir, f"cg{index}")
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    sys.executable, __file__, "--inside", "--calls", str(calls), "--pairs", str(pairs)],
                   env=env, capture_output=True, check=True)
    blocks = []
    for path in sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1])):
        text = open(path).read()
        which = re.search(r"^desc: Trigger: dump (\w+)", text, re.M).group(1)
        blocks.append((which, int(re.search(r"^totals: (\d+)", text, re.M).group(1)) / calls))
    tiled = [n for which, n in blocks if which == "tiled"]
    bare = [n for which, n in blocks if which == "bare"]
    return [t - b for t, b in zip(tiled, bare, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        _measure_here(args.calls, args.pairs)
        return
    differences = []
    with tempfile.TemporaryDirectory() as out_dir:
        for index in range(args.processes):
            found = _process(args.calls, args.pairs, out_dir, index)
            print(f"process {index + 1}: " + ", ".join(f"{d / 1000:.1f}K" for d in found), flush=True)
            differences += found
    print(f"tiled over bare: {statistics.mean(differences) / 1000:.1f}K instructions per call "
          f"({min(differences) / 1000:.1f}K-{max(differences) / 1000:.1f}K over {len(differences)} pairs)")


if __name__ == "__main__":
    main()
