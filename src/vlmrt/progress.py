"""The progress display of long jobs (export, checkpoint assembly): one line per step on stderr,
`[2/6] vision graph ... 3.1 s`, ended with " failed" when the step raises."""

from __future__ import annotations

import sys
import time


class Progress:
    """One line per step on stderr: `[2/6] vision graph ... 3.1 s`."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled = total, 0, enabled
        self.t = 0.0
        self.open = False

    def start(self, what: str) -> None:
        self.n += 1
        self.t = time.perf_counter()
        self.open = True
        if self.enabled:
            print(f"[{self.n}/{self.total}] {what} ...", end="", file=sys.stderr, flush=True)

    def done(self, note: str = "") -> None:
        self.open = False
        if self.enabled:
            extra = f" {note}" if note else ""
            print(f" {time.perf_counter() - self.t:.1f} s{extra}", file=sys.stderr, flush=True)

    def failed(self) -> None:
        """End an open step's line so that the error message starts on its own line."""
        if self.open and self.enabled:
            print(" failed", file=sys.stderr, flush=True)
        self.open = False
