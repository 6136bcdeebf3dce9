"""Huge pages under the weights a session packed: MADV_COLLAPSE over the process's populated anonymous memory.

A decode step streams every packed weight once (SmolLM2-135M w4a8: ~101 MB of MatMulNBits blocks that ORT
prepacks into malloc'd memory when the session is built). On 4 KiB pages that is ~25,000 pages a step, far past what
the TLB holds (Zen 4: 3,072 L2 entries, 12 MB), so each page costs a page walk, every step. Where the system's
transparent huge pages are `madvise` (the common default), malloc's memory never gets 2 MiB pages on its own, and ORT
has no option to ask for them. After a session is built, `collapse_populated` asks the kernel to remap each
anonymous read-write region that is all but 0.1 % resident (the heap and malloc's mapped chunks holding the packed
weights) onto 2 MiB pages in place (madvise MADV_COLLAPSE, Linux 6.1+): the same bytes at the same addresses, no
lasting flag on the mapping (later faults stay on 4 KiB pages, so memory that is touched sparsely, as the KV cache
at a short prompt, is not made resident; the KV cache's own mapping refuses huge pages anyway). Regions mostly
unpopulated are left alone: collapsing fills a 2 MiB block's missing pages, and that would grow the resident set.
Measured (docs/performance.md, "The decode step's fixed cost, and huge pages under the packed weights"): a w4a8
SmolLM2-135M decode step 5-17 % shorter at 128 and 1024 tokens, resident memory unchanged. Nothing changes where the
call fails: another OS, a kernel before 6.1 (EINVAL), THP `never`.
"""

from __future__ import annotations

import ctypes
import sys

MADV_COLLAPSE = 25  # linux/mman.h (6.1+)
HUGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size
MIN_BYTES = 4 << 20  # smaller regions hold no packed weights worth a collapse
POPULATED = 0.999  # a region's resident share at least this: collapsing grows its resident set by < 0.1 %
# (at 0.9, a multi-GB process (the test suite's) could grow by hundreds of MB filling its regions' holes)

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _libc = libc
    return _libc.madvise


def enabled() -> bool:
    """Whether this system can back anonymous memory with transparent huge pages (Linux, THP not `never`)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def populated_regions(min_bytes: int = MIN_BYTES, populated: float = POPULATED) -> list[tuple[int, int]]:
    """[start, end) of each anonymous read-write mapping (no file; the heap counts) of at least min_bytes whose
    resident share is at least `populated`, narrowed to whole 2 MiB blocks (/proc/self/smaps)."""
    out: list[tuple[int, int]] = []
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if head[0].endswith(":"):
                if head[0] == "Rss:" and cur is not None:
                    lo, hi = cur
                    if int(head[1]) * 1024 >= populated * (hi - lo):
                        a, b = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
                        if b > a:
                            out.append((a, b))
                    cur = None
                continue
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            path = head[5].strip() if len(head) > 5 else ""
            anon = path in ("", "[heap]")
            cur = (lo, hi) if anon and head[1].startswith("rw") and hi - lo >= min_bytes else None
    return out


def collapse_populated() -> int:
    """Remap the process's populated anonymous regions onto huge pages (module doc); returns the bytes collapsed
    (0 where the system cannot)."""
    if not enabled():
        return 0
    madvise, done = _madvise(), 0
    for a, b in populated_regions():
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
    return done
