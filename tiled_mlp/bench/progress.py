"""A progress bar on stderr: tqdm when installed, a plain counter otherwise."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool = True):
        self._bar = None
        self._count, self._total, self._desc, self._enabled = 0, total, desc, enabled
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self._count += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            self._bar.update(1)
        elif self._enabled:
            print(f"[{self._count}/{self._total}] {self._desc}: {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
