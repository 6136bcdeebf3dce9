"""Weights the host maps itself: float initializers shared between sessions over one memory map, MatMulNBits
scales unmapped while a session builds, the token-embedding table's rows (int8 + scales or float)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..format import manifest as mf


class SharedWeights:
    """Graph initializers kept in the bundle's data files, memory-mapped once and handed to every
    session as OrtValues over the mapping (SessionOptions.add_initializer): the prefill and decode sessions
    of a two-graph bundle then share one copy of the weights — the page cache's — instead of each
    reading its own. Keyed by file, offset, dtype and shape, the same bytes give the same OrtValue.

    MatMulNBits inputs are left out: the CPU kernel computes from its own prepacked copy, and ORT, when it
    maps such a weight itself, drops the mapping once the copy exists; a shared mapping would keep both
    resident for the session's life (memory figures: docs/performance.md). The scales and zero points among them
    (GraphSpec.load_only_weights) are mapped one weight per mapping (own=True), whose pages drop_pages unmaps while
    the session is built (dropping)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.maps: dict[str, mmap.mmap] = {}
        self.values: dict[tuple, object] = {}
        self.own: dict[tuple, mmap.mmap] = {}  # (file, offset, length) -> the mapping of that weight alone

    def initializers(self, graph: mf.GraphSpec, weights: list[dict] | None = None, own: bool = False) -> dict[str, object]:
        """name -> OrtValue for the graph's mapped weights (GraphSpec.mapped_weights, written by the export), or for
        those of the list weights; own: each in a mapping of its own pages (a page fault maps up to 64 KB around it,
        within one mapping: a whole-file one would gather the neighbouring weights' pages too)."""
        import onnxruntime as ort

        out = {}
        for w in graph.mapped_weights if weights is None else weights:
            try:
                dtype, shape = np.dtype(w["dtype"]), tuple(w["shape"])
            except TypeError:
                raise mf.BundleError(f"graph {graph.file}: weight {w['name']!r} has an unknown dtype {w['dtype']!r}") from None
            key = (w["file"], w["offset"], w["length"], dtype.str, shape)
            if key not in self.values:
                try:
                    buf, at = self._mapping(w, own)
                    arr = np.frombuffer(buf, dtype=np.uint8, count=w["length"], offset=at).view(dtype).reshape(shape)
                except ValueError as e:
                    raise mf.BundleError(f"graph {graph.file}: weight {w['name']!r} does not fit {w['file']}: {e}") from None
                self.values[key] = ort.OrtValue.ortvalue_from_numpy(arr)
            out[w["name"]] = self.values[key]
        return out

    def _mapping(self, w: dict, own: bool) -> tuple[mmap.mmap, int]:
        """(mapping, the weight's offset in it)."""
        if not own:
            if w["file"] not in self.maps:
                with open(self.folder / w["file"], "rb") as f:
                    self.maps[w["file"]] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self.maps[w["file"]], w["offset"]
        start = w["offset"] // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        key = (w["file"], w["offset"], w["length"])
        if key not in self.own:
            with open(self.folder / w["file"], "rb") as f:
                self.own[key] = mmap.mmap(f.fileno(), w["offset"] + w["length"] - start, offset=start,
                                          access=mmap.ACCESS_READ)
        return self.own[key], w["offset"] - start

    def drop_pages(self, weights: list[dict]) -> None:
        """Unmap the resident pages of these weights' own mappings (MADV_DONTNEED: the file stays in the page cache;
        a later read faults them back in, so this is safe whoever reads them, and when). For GraphSpec.load_only_weights
        while their session is built: ORT's x86 int8-compute MatMulNBits copies the scales into its packed weights and
        keeps the originals, which it never reads again (16 MB for SmolLM2-135M w4a8; docs/performance.md#memory)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for w in weights:
            m = self.own.get((w["file"], w["offset"], w["length"]))
            if m is not None:
                m.madvise(mmap.MADV_DONTNEED)

    @contextlib.contextmanager
    def dropping(self, weights: list[dict], every_s: float = 0.02):
        """drop_pages(weights) every every_s seconds while the block runs (a session build: ORT releases the GIL
        while it prepacks), and once more at its end. ORT packs node by node and never reads a node's scales again,
        so their pages need not pile up until the session exists: for SmolLM2-135M w4a8 that pile was the load's
        peak, 14 MB above what stays (docs/performance.md#memory)."""
        done = threading.Event()

        def drop() -> None:
            while not done.wait(every_s):
                self.drop_pages(weights)

        t = threading.Thread(target=drop, name="vlmrt-drop-pages", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self.drop_pages(weights)


class EmbeddingRows:
    """A bundle's [vocab, hidden] embedding table (.npy), read a few rows at a time with pread. A prompt touches a
    few hundred scattered rows; through a memory map each row faults in (and counts in RSS) the 64 KB around it
    (most of an int8 table after a long prompt; docs/performance.md)."""

    def __init__(self, path: Path):
        arr = np.load(path, mmap_mode="r")  # reads the header: shape, dtype, where the rows start
        if not arr.flags.c_contiguous:
            raise mf.BundleError(f"{path.name}: the embedding table must be C-ordered")
        self.shape, self.dtype, self._offset = arr.shape, arr.dtype, arr.offset
        self._row = arr.shape[1] * arr.dtype.itemsize
        del arr
        self._fd = os.open(path, os.O_RDONLY)
        self._one_row = np.empty(self.shape[1], self.dtype)  # row()'s buffer
        self._one = memoryview(self._one_row.view(np.uint8))

    def __getitem__(self, ids) -> np.ndarray:
        """ids [n] -> rows [n, hidden]"""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"token id out of range 0..{self.shape[0] - 1}")
        out = np.empty((ids.size, self.shape[1]), self.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        row = self._row
        for i, t in enumerate(ids.tolist()):
            if os.preadv(self._fd, [buf[i * row : (i + 1) * row]], self._offset + t * row) != row:
                raise mf.BundleError("embedding table file is truncated")
        return out

    def row(self, token: int) -> np.ndarray:
        """Token's row [hidden] (0 <= token < vocab, unchecked here), in a buffer the next call overwrites."""
        self.read_into(token, self._one)
        return self._one_row

    def read_into(self, token: int, buf) -> None:
        """Token's row (0 <= token < vocab, unchecked here) into buf, a writable buffer of one row's bytes (the
        decode step's bound input, StepBuffers.token_row)."""
        if os.preadv(self._fd, [buf], self._offset + token * self._row) != self._row:
            raise mf.BundleError("embedding table file is truncated")

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def release_freed_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc's malloc_trim; a no-op elsewhere). Parsing the
    tokenizer's JSON and the graphs leaves freed heap that RSS keeps counting."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
