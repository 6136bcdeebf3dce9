"""Folders written whole or not at all: the work happens in a sibling `.OUT.<kind>-<pid>` folder, which replaces
OUT by a rename at the end (`publish`); a failure removes it. Work folders left by a process that was killed
(SIGKILL, power loss) are removed by the next job on the same OUT (`work_folder`).

    with staged(out) as work:          # .out.tmp-<pid>, fresh
        ... write into work ...
        publish(work, out)             # out replaced in one rename
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from pathlib import Path
from typing import Iterator


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove the work folders next to out whose process is gone. Returns what it removed."""
    gone = []
    for p in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        _, _, pid = p.name[len(out.name) + 2:].rpartition("-")
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def work_folder(out: Path, kind: str = "tmp") -> Path:
    """A fresh, empty `.OUT.<kind>-<pid>` next to out (stale ones of dead processes removed first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    work = out.parent / f".{out.name}.{kind}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    return work


@contextlib.contextmanager
def staged(out: Path, kind: str = "tmp") -> Iterator[Path]:
    """A work folder for out that is removed if the block raises (or did not publish it)."""
    work = work_folder(Path(out), kind)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(work: Path, out: Path) -> None:
    """Replace out (a folder or a file, if any) with the folder work, by a rename."""
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        out.unlink()
    os.replace(work, out)
