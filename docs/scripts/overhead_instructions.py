"""Instructions a warm call of one of ``tiled-mlp bench-overhead``'s functions executes, counted by callgrind:
deterministic, so a loaded machine does not move it (docs/architecture.md, "Budgets (measured)").

    PYTHONHASHSEED=0 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/tmp/cg.tiled \\
        python docs/scripts/overhead_instructions.py tiled 100
    # the same with "bare"; (tiled - bare) / 100 is the tiled call's own cost per call.

Only the measured calls are instrumented (``callgrind_control -i on/off`` around them); put a checkout first
on PYTHONPATH to measure it (a script run by path otherwise imports the installed package).
"""
import os
import subprocess
import sys

import tiled_mlp.bench.overhead as overhead

FUNCTIONS = {"tiled": "tiled forward+backward (4 shards)", "bare": "bare Function forward+backward (4 shards)",
             "kernel": "kernel work forward+backward (4 shards)"}

if __name__ == "__main__":
    which, calls = sys.argv[1], int(sys.argv[2])
    captured = {}

    def keep(fns, calls, blocks=9):  # the bench's own functions, built as it builds them, not timed
        captured.update(fns)
        return {name: 1.0 for name in fns}

    overhead.per_call_us = keep
    overhead.measure(calls=10)
    fn = captured[FUNCTIONS[which]]
    for _ in range(50):
        fn()
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], capture_output=True, check=False)
    for _ in range(calls):
        fn()
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], capture_output=True, check=False)
