"""The packed weights on huge pages (runtime/huge_pages.py): a populated anonymous region is remapped onto 2 MiB pages in
place, a sparse one is left alone, and every session the runtime builds is followed by the collapse."""

import mmap
import os
import platform

import numpy as np

from vlmrt.runtime import huge_pages


def _kernel_collapses() -> bool:
    """MADV_COLLAPSE needs Linux 6.1+ with transparent huge pages not `never`."""
    if not huge_pages.enabled():
        return False
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


def _anon_huge_kb(start: int) -> int:
    """AnonHugePages of the mapping holding address start (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= start < hi
            elif inside and head[0] == "AnonHugePages:":
                return int(head[1])
    raise AssertionError("address not mapped")


def _mapping(mb: int):
    """A private anonymous mapping of its own (MADV_DONTFORK: flags unlike its neighbours', so that the kernel does not
    merge it with an adjacent mapping) and its address; nothing resident yet."""
    import ctypes
    import mmap

    m = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_DONTFORK)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_a_populated_region_goes_onto_huge_pages_and_a_sparse_one_does_not():
    """Holds on every system: where the kernel collapses (Linux 6.1+, THP not `never`) the populated region is on huge
    pages after the call; elsewhere the call asks nothing. A sparse region is never filled in, whatever the system's
    THP mode (under `always` its faults may already have made huge pages: the call adds none)."""
    m, start = _mapping(24)
    a = np.frombuffer(m, np.uint8)
    a[:: 1 << 20] = 1  # one page in 256 resident (madvise / never): collapsing would make 24 MiB of it resident
    rss, huge = _rss_kb(), _anon_huge_kb(start)
    huge_pages.collapse_populated()
    assert _rss_kb() - rss < 4 << 10
    assert _anon_huge_kb(start) == huge
    m2, start2 = _mapping(64)
    m2.madvise(mmap.MADV_DONTDUMP)  # (flags unlike the first mapping's too: the two are not merged into one region)
    b = np.frombuffer(m2, np.uint8)
    pages = b.reshape(-1, 4096)
    pages[np.arange(len(pages)) % 20 != 0, 0] = 3  # 95 % resident, a hole in every 20 pages (a big process's heap):
    # a collapse would fill 3.2 MiB of it
    rss, huge = _rss_kb(), _anon_huge_kb(start2)
    huge_pages.collapse_populated()
    assert _rss_kb() - rss < 1 << 10 and _anon_huge_kb(start2) == huge
    del b, pages
    m2.close()
    a[:] = 2  # every page resident, as a session's packed weights are
    done = huge_pages.collapse_populated()
    if _kernel_collapses():
        # its whole 2 MiB blocks (10 or 11), or those the kernel found free huge pages for on a fragmented machine
        assert _anon_huge_kb(start) >= 2 << 10
    else:
        assert done == 0
    assert np.all(a == 2)  # the same bytes
    del a
    m.close()


def _rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_each_session_the_runtime_builds_is_followed_by_the_collapse(default_bundle, monkeypatch):
    from vlmrt.runtime.vlm import VLM

    calls = []
    monkeypatch.setattr(huge_pages, "collapse_populated", lambda: calls.append(1) or 0)
    vlm = VLM.load(default_bundle.bundle, threads=1)
    assert calls, "the decoder's session was built without the collapse after it"
    n = len(calls)
    vlm.bundle.sessions["vision"]
    assert len(calls) == n + 1
