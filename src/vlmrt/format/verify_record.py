"""Remembered bundle verifications: a file's sha256 is computed once and trusted again while the file provably has
not changed since (stdlib only).

After `manifest.verify_files` has hashed a bundle's files, it stores a record in the user's cache
(``$VLMRT_CACHE/verified/`` or ``~/.cache/vlmrt/verified/``, one JSON file per bundle folder, written to a temp file
and renamed). A later load skips a file's sha256 when its record matches all of:

- the manifest: the record is for the sha256 of this exact manifest.json, and the entry's expected sha256;
- the file's identity and state: (size, mtime_ns, ctime_ns, inode, device) from ``stat``.

Why this is safe: a write to a file, in place or not, sets its mtime and ctime to the current time; a rename or
copy gives another inode; ``utime`` can put mtime back but sets ctime to now, and ctime cannot be set by any user
call (only by changing the system clock, or by writing the disk under the filesystem: root). Timestamps have a
granularity (jiffies on Linux, seconds on some filesystems), so a file changed within one tick of its last change
keeps its timestamps: a file is recorded only if it was last changed more than RACY_NS before the verification
began (git's "racily clean" rule), and only if its stat is the same after hashing as before. A record is read
only if the current user owns it and nobody else can write it. Limits: docs/limits.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

RACY_NS = 2_000_000_000  # a file changed less than this before its verification is hashed again next time


def cache_root() -> Path:
    """vlmrt's per-user cache folder: $VLMRT_CACHE or ~/.cache/vlmrt."""
    env = os.environ.get("VLMRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlmrt"


def _now_ns() -> int:
    return time.time_ns()


def identity(st: os.stat_result) -> list[int]:
    """What a change to the file changes: size, mtime, ctime (ns), inode, device."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _trusted(path: Path) -> bool:
    """A record file (and its folder) owned by this user and writable by nobody else."""
    try:
        for p in (path.parent, path):
            st = p.lstat()
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                return False
    except OSError:
        return False
    return path.is_file() and not path.is_symlink()


class Record:
    """The remembered verifications of one bundle folder under one manifest (its sha256)."""

    def __init__(self, folder: Path, manifest_bytes: bytes):
        self.folder = os.path.realpath(folder)
        self.manifest = hashlib.sha256(manifest_bytes).hexdigest()
        key = hashlib.sha256(self.folder.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        self.path = cache_root() / "verified" / f"{key}.json"
        self.started = _now_ns()
        self.old: dict[str, list] = {}
        self.new: dict[str, list] = {}
        if _trusted(self.path):
            try:
                d = json.loads(self.path.read_text())
                if d.get("folder") == self.folder and d.get("manifest_sha256") == self.manifest:
                    self.old = {k: v for k, v in d.get("files", {}).items() if isinstance(v, list)}
            except (OSError, ValueError, AttributeError):
                pass  # an unreadable record is no record

    def holds(self, name: str, st: os.stat_result, sha256: str) -> bool:
        """Whether name, now with stat st, was verified to have sha256 and has not changed since."""
        ok = self.old.get(name) == [sha256, *identity(st)]
        if ok:
            self.new[name] = self.old[name]
        return ok

    def add(self, name: str, before: os.stat_result, after: os.stat_result, sha256: str) -> None:
        """name was hashed to sha256 between stats before and after: remember it unless it changed meanwhile or
        was changed too recently for its timestamps to tell a later change apart."""
        if identity(before) == identity(after) and max(after.st_mtime_ns, after.st_ctime_ns) < self.started - RACY_NS:
            self.new[name] = [sha256, *identity(after)]

    def save(self) -> None:
        """Write the record (atomically: temp file + rename) if it changed; a cache that cannot be written is
        no error, the next load hashes again."""
        if self.new == self.old:
            return
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            body = json.dumps({"folder": self.folder, "manifest_sha256": self.manifest, "files": self.new})
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(body)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass
