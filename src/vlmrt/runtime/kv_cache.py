"""The KV cache outside the graphs — the one definition of how it is read and updated.

Layout (manifest `kv`): per layer a K and a V buffer [max_context, dim]; slot p holds the
(post-RoPE) key/value of the token at absolute position p. A graph step over AR tokens at
positions pos..pos+AR-1 reads all slots (or the prefix `context_slots` gives), masked so that slots < pos are visible and the
step's own tokens see each other causally, and returns AR new rows per buffer; `write`
stores the first n_valid of them at slots pos..pos+n_valid-1 (padding rows are dropped).
families/layers.py:CachedGQAttention is the graph side; tests/test_kv_contract.py checks both.

Layout "in_place" (manifest kv.layout; the CPU target's GroupQueryAttention decoder): per layer a K and a V buffer
[1, heads, max_context, head_dim] that the graph reads whole and writes the step's rows into itself (the same
buffers are bound as its past_* inputs and present_* outputs), so `write` only advances the length.
"""

from __future__ import annotations

import mmap

import numpy as np

from ..manifest import KVSpec


def attention_mask(pos: int, ar: int, max_context: int, dtype=np.float32, out: np.ndarray | None = None,
                   neg: float | None = None) -> np.ndarray:
    """Additive mask [ar, max_context + ar] for a step whose first token is at position pos.

    neg is the value of hidden slots: the dtype's lowest by default; quantized (HTP) graphs use a
    moderate value (manifest decoder.mask_value) so that the mask does not eat the 16-bit range."""
    neg = np.finfo(dtype).min if neg is None else neg
    m = out if out is not None else np.empty((ar, max_context + ar), dtype)
    m.fill(neg)
    m[:, :pos] = 0  # the cache holds positions 0..pos-1
    m[:, max_context:][np.tril_indices(ar)] = 0  # causal within the step
    return m


def zeroed(shape: tuple, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) in its own anonymous mapping, with huge pages refused (MADV_NOHUGEPAGE): numpy
    advises huge pages for arrays of 4 MB or more, so the first row written into a cache buffer would make the whole
    2 MB around it resident (a 16-token prompt: 42 of a 45 MB cache; docs/performance.md#memory). Here only the pages
    the rows are written to count. np.zeros where mmap has no private anonymous mappings."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None or n == 0:
        return np.zeros(shape, dtype)
    m = mmap.mmap(-1, n, flags=flags | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, dtype).reshape(shape)  # the array keeps the mapping alive


def context_slots(pos: int, step: int, max_context: int) -> int:
    """The cache prefix [:ctx] a step at first position pos reads from a graph with a symbolic cache length
    (manifest decoder.context_step = step > 0): pos rounded up to a multiple of step, at least step, at most
    max_context. The prefix holds positions 0..pos-1."""
    return min(max_context, max(step, -(-pos // step) * step))


class KVCache:
    def __init__(self, spec: KVSpec, dtype=None):
        self.spec = spec
        self.dtype = np.dtype(dtype or spec.dtype)
        self.in_place = spec.layout == "in_place"
        # one block [layers, 2 (K, V), max_context, dim]: keys[i] / values[i] are views of it, so a step's
        # new rows land in every buffer with one copy (write), and graph inputs bind to prefixes of it;
        # in_place: [layers, 2, 1, heads, max_context, head_dim], the graph's buffers
        shape = (1, spec.heads, spec.max_context, spec.head_dim) if self.in_place else (spec.max_context, spec.dim)
        self.data = zeroed((spec.layers, 2, *shape), self.dtype)
        self.keys = [self.data[i, 0] for i in range(spec.layers)]
        self.values = [self.data[i, 1] for i in range(spec.layers)]
        if not self.in_place:
            self._by_slot = self.data.transpose(2, 0, 1, 3)  # [max_context, layers, 2, dim]: write's view
        self.length = 0  # number of valid slots (= next position)
        self.epoch = 0  # counts resets: rows kept across calls (a prefix reuse) belong to one epoch
        # clear_unused's "clean from" mark: slots >= max(_written, length) were not written since the last clear and
        # each buffer's hold the byte _tail[kind][i] (np.zeros: 0). Rows land only at length.. (write), so a slot
        # is written past the kept length only when reset / rewind lowers the length: they raise _written first
        self._written = 0
        self._tail = {kind: [0.0] * spec.layers for kind in ("key", "value")}

    def reset(self) -> None:
        self._written = max(self._written, self.length)
        self.length = 0  # stale rows beyond length are masked (and reset to the zero point by clear_unused)
        self.epoch += 1

    def rewind(self, n: int) -> None:
        """Keep rows 0..n-1 and write the next step's rows from slot n on: a prefix reuse. Slots >= n are then
        stale, masked like those beyond length always are, and overwritten by the next writes."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} rows of a cache holding {self.length}")
        self._written = max(self._written, self.length)
        self.length = n

    def feeds(self, ctx: int | None = None) -> dict[str, np.ndarray]:
        """The cache as graph inputs; ctx < max_context gives the prefix [:ctx] (a contiguous view, no copy).
        in_place: the whole buffers."""
        s = self.spec
        f = {}
        for i in range(s.layers):
            f[s.key_input.format(layer=i)] = self.keys[i] if self.in_place else self.keys[i][:ctx]
            f[s.value_input.format(layer=i)] = self.values[i] if self.in_place else self.values[i][:ctx]
        return f

    def stored(self, n: int | None = None) -> np.ndarray:
        """Rows 0..n-1 (default: the length) as [layers, 2, n, dim], whatever the layout (in_place: a copy)."""
        n = self.length if n is None else n
        if not self.in_place:
            return self.data[:, :, :n]
        s = self.spec
        return self.data[:, :, 0, :, :n].transpose(0, 1, 3, 2, 4).reshape(s.layers, 2, n, s.dim)

    def output_names(self) -> list[str]:
        s = self.spec
        return [n.format(layer=i) for i in range(s.layers) for n in (s.key_output, s.value_output)]

    def clear_unused(self, enc: dict) -> None:
        """Slots length.. of a uint8 cache hold 0 under enc (per layer (scale, zp) of K and V: the encoding of the
        graph that reads them next), i.e. byte zp. Byte 0 (np.zeros, or a stale row) reads back as -zp*scale in
        every dim: a key row whose score q.k/sqrt(d) on a real decoder (large-mean queries) is far above the
        -100 of an HTP mask, and a float (fp16) graph, which does not clip its scores to a calibrated range as a
        QDQ graph does, then attends to the hidden slot (measured: SmolLM2's fp16 prefill, top-1 0.61 -> 0.9+).
        Only what changed is written: the slots written since the last clear (up to the "clean from" mark), or the
        whole tail of a buffer whose zero point differs from the one its tail holds (prefill's vs decode's).
        Layout rows only (the HTP's; an in_place graph writes rows past the length itself)."""
        n, end = self.length, max(self._written, self.length)
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                z, tail = enc[kind][i][1], self._tail[kind]
                if tail[i] != z:
                    buf[n:] = tail[i] = z
                elif n < end:
                    buf[n:end] = z
        self._written = n

    def requantize(self, src: dict, dst: dict) -> None:
        """Re-express the uint8 rows 0..length from encoding src into dst (per layer (scale, zp) of K and V):
        q_dst = clip(round((q_src - zp_src) * s_src / s_dst) + zp_dst, 0, 255); the unused slots become dst's
        zero (clear_unused)."""
        n = self.length
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                (s1, z1), (s2, z2) = src[kind][i], dst[kind][i]
                if s1 == s2 and z1 == z2:
                    continue
                x = (buf[:n].astype(np.float32) - z1) * (s1 / s2)
                buf[:n] = np.clip(np.rint(x) + z2, 0, 255).astype(np.uint8)
        self.clear_unused(dst)

    def _slots(self, n_valid: int) -> slice:
        """The slots the next n_valid rows go to (length..length+n_valid-1); the caller advances length
        once they are written."""
        pos = self.length
        if pos + n_valid > self.spec.max_context:
            raise OverflowError(f"KV cache full: {pos} + {n_valid} > {self.spec.max_context}")
        return slice(pos, pos + n_valid)

    def write(self, rows: np.ndarray | None, n_valid: int) -> None:
        """rows [layers, 2 (K, V), ar, dim], a step's new rows (runtime/step.py stages them in one block): store the
        first n_valid at slots length..length+n_valid-1 (padding rows are dropped), then advance length.
        in_place (rows None): the graph stored them; only the length advances (rows it wrote beyond, a lookahead
        step's rejected drafts, are stale slots like any beyond the length)."""
        pos = self.length
        if rows is None:
            if pos + n_valid > self.spec.max_context:
                self._slots(n_valid)  # raises
            self.length = pos + n_valid
            return
        if n_valid == 1 and pos < self.spec.max_context:  # a decode step: one assignment (no slices)
            self._by_slot[pos] = rows.transpose(2, 0, 1, 3)[0]
            self.length = pos + 1
            return
        at = self._slots(n_valid)
        self.data[:, :, at] = rows[:, :, :n_valid]
        self.length = at.stop
