"""The output of `vlmrt batch`: an append-only JSONL file, one line per record, written by the driver alone.

    {"id": "a1", "text": "green", "token_ids": [...], "prompt_tokens": 27, "stats": {...}}   # as `vlmrt run --json`
    {"id": "a2", "error": "image not found: /data/b.png"}

Resuming: the ids already in OUT (answered or not) are skipped by a rerun with the same options (`<OUT>.options.json`
records them; a rerun with others is refused). A run that was killed can leave a last
line cut short; `open_output` drops it (the record is then done again). Each line is written with one write() and
flushed; the file is fsynced every few seconds and at the end. A record that comes back twice (a retried task after
a worker died) is written once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

FSYNC_EVERY_S = 5.0


class OutputError(ValueError):
    """OUT cannot be used (not ours, unreadable): the job does not start."""


def _lines(path: Path) -> list[bytes]:
    try:
        return path.read_bytes().split(b"\n")[:-1]
    except OSError as e:
        raise OutputError(f"cannot read --output {path}: {e.strerror or e}") from None


def repair(path: Path, say: bool = True) -> int:
    """Cut a torn last line (no newline at its end: a killed run's) off OUT; returns the bytes dropped."""
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return 0
        keep = _last_newline(f, size)
        f.truncate(keep)
    if say:
        print(f"vlmrt: {path} ended in a partial line (an interrupted run): dropped it ({size - keep} bytes)",
              file=sys.stderr, flush=True)
    return size - keep


def _last_newline(f, size: int, chunk: int = 1 << 16) -> int:
    """The offset just after the last b"\\n" in the file (0 when there is none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        f.seek(start)
        at = f.read(end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def options_path(path: Path) -> Path:
    """Where the options that OUT's answers were made with are kept: `<OUT>.options.json` next to it."""
    return path.with_name(path.name + ".options.json")


def check_options(path: Path, options: dict, has_lines: bool) -> None:
    """Record the answer-changing options of this job next to OUT, or, when OUT already has lines, refuse a job
    whose options differ from those they were made with (a resume must not mix answers to two questions). An OUT
    with lines but no record (written before options were recorded) is taken as it is, and the record written."""
    side = options_path(path)
    options = json.loads(json.dumps(options))  # as it reads back (tuples are lists)
    if has_lines and side.is_file():
        try:
            then = json.loads(side.read_text())
        except (OSError, ValueError) as e:
            raise OutputError(f"cannot read {side}: {e}; remove it if OUT's options are known to be this job's") from None
        changed = sorted(k for k in set(then) | set(options) if then.get(k) != options.get(k))
        if changed:
            said = ", ".join(f"{k} {json.dumps(then.get(k))} then, {json.dumps(options.get(k))} now" for k in changed)
            raise OutputError(f"--output {path} holds answers made with other options ({said}): rerun with the same "
                              "options, or give another --output")
        return
    tmp = side.with_name(f".{side.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(options, sort_keys=True) + "\n")
        os.replace(tmp, side)
    except OSError as e:
        raise OutputError(f"cannot write {side}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def done_keys(path: Path) -> tuple[set[str], set[str]]:
    """(keys of every line in OUT, keys of the error lines); OUT must be a `vlmrt batch` output (repaired)."""
    from .records import id_key

    keys, errors = set(), set()
    if not path.exists():
        return keys, errors
    for n, line in enumerate(_lines(path), 1):
        try:
            obj = json.loads(line)
            key = id_key(obj["id"])
        except (ValueError, TypeError, KeyError):
            raise OutputError(f"--output {path} line {n} is not a vlmrt batch line; give another --output") from None
        keys.add(key)
        if "error" in obj:
            errors.add(key)
    return keys, errors


def drop_errors(path: Path) -> int:
    """Rewrite OUT without its error lines (--retry-errors), whole or not at all; returns how many were dropped."""
    lines = _lines(path) if path.exists() else []
    keep = [ln for ln in lines if "error" not in json.loads(ln)]
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(b"".join(ln + b"\n" for ln in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return len(lines) - len(keep)


class Writer:
    """Appends result lines to OUT; each key once."""

    def __init__(self, path: Path, done: set[str]):
        self.path = path
        self.written: set[str] = set(done)
        self.duplicates = 0
        try:
            self.f = open(path, "ab")
        except OSError as e:
            raise OutputError(f"cannot write --output {path}: {e.strerror or e}") from None
        self.synced = time.monotonic()

    def write(self, key: str, line: str) -> bool:
        """Append one line (a JSON object's text); False when its key is in OUT already."""
        if key in self.written:
            self.duplicates += 1
            return False
        self.written.add(key)
        self.f.write(line.encode("utf-8") + b"\n")
        self.f.flush()
        if time.monotonic() - self.synced > FSYNC_EVERY_S:
            os.fsync(self.f.fileno())
            self.synced = time.monotonic()
        return True

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
