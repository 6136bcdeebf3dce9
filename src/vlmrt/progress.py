"""The progress display of long jobs: Progress, one line per step on stderr (export, checkpoint assembly),
`[2/6] vision graph ... 3.1 s`, ended with " failed" when the step raises; Meter, a bar of items done / total with
the rate and the ETA (`vlmrt batch`)."""

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


class Laps:
    """Sub-steps of one long step, for its Progress note: `calibration 840 s, vision 30 s, ...` (call it after each)."""

    def __init__(self):
        self.t, self.laps = time.perf_counter(), []

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        self.laps.append(f"{what} {now - self.t:.0f} s")
        self.t = now

    def __str__(self) -> str:
        return ", ".join(self.laps)


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Meter:
    """A bar for jobs of many items on stderr: `[#####.......] 120/400 records  10.3 records/s  ETA 0:27`.
    The rate (and so the ETA) counts from the first item done, so a job's startup (loading models, starting
    workers) does not drag it down. On a terminal the line is redrawn in place (at most 10 times a second);
    otherwise a line is printed every `every_s` seconds and at the end, so that logs stay short."""

    WIDTH = 24

    def __init__(self, total: int, what: str = "records", enabled: bool = True, every_s: float = 10.0):
        self.total, self.what, self.enabled, self.every_s = total, what, enabled, every_s
        self.done = 0
        self.first: tuple[float, int] | None = None  # (time, items done) after the first advance
        self.shown = -1.0
        self.tty = enabled and sys.stderr.isatty()

    MIN_RATE_S = 2.0  # no rate before this long after the first items (they come in batches)

    def rate(self) -> float:
        if self.first is None:
            return 0.0
        dt = time.perf_counter() - self.first[0]
        return (self.done - self.first[1]) / dt if dt >= self.MIN_RATE_S else 0.0

    def line(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.WIDTH) + "." * (self.WIDTH - int(frac * self.WIDTH))
        r = self.rate()
        if self.done >= self.total:
            eta = "0:00"
        else:
            eta = _clock((self.total - self.done) / r) if r > 0 else "?"
        rate = f"{r:.1f}" if r > 0 else "?"
        return f"[{bar}] {self.done}/{self.total} {self.what}  {rate} {self.what}/s  ETA {eta}"

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.first is None:
            self.first = (time.perf_counter(), self.done)
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.done >= self.total or now - self.shown >= (0.1 if self.tty else self.every_s):
            self.shown = now
            end = "\r" if self.tty and self.done < self.total else "\n"
            print(("\r" if self.tty else "") + self.line(), end=end, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar's line (a job stopped before the total leaves a redrawn line open)."""
        if self.enabled and self.tty and self.done < self.total:
            print(file=sys.stderr, flush=True)
