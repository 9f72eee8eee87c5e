"""The ``tiled-mlp`` command leaves through the interpreter's ordinary exit, with ``main()``'s status: what
is still running when the command returns (a thread that is not a daemon) finishes, as in any Python program."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_exits_the_ordinary_way_with_its_status():
    script = ("import threading, time\n"
              "from tiled_mlp.cli import main\n"
              "main.main = lambda: 3\n"
              "threading.Thread(target=lambda: (time.sleep(0.5), print('the thread finished', flush=True))).start()\n"
              "main.run()\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["the thread finished"], done.stdout
