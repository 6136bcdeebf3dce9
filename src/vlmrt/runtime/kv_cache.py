"""The decoder's state outside the graphs — the one definition of how it is stored, read and updated.

The manifest's `kv.layers` lists one entry per decoder layer, by kind (manifest.CACHE_LAYER_KINDS), and this cache
is built from that list alone, so a family with mixed layers needs no engine change:
  attention  a K and a V row per slot: slot s holds the (post-RoPE) key/value of the row written at slot s. Layers
             of one shape share one block [layers, 2 (K, V), *buffer] (a step's new rows land in all of them with
             one copy); layers of other widths get a block of their own.
  conv       one row [channels] per slot of a short convolution's input, of which a step reads the `width` rows
             before its first slot (a window, load_windows: [width, channels], or the layout's [1, width, channels])
             and returns its own rows ([ar, channels] / [1, ar, channels]), written at its slots like K/V rows.
How an attention buffer is laid out is the decoder kind's (runtime/decoder_kinds.py): `ROWS` [max_context, kv_dim]
(the rows contract: a step reads all slots or the prefix `context_slots` gives, masked so that slots < the step's
first slot are visible and its own rows see each other causally, and returns its new rows; `write` stores the
first n_valid at the next slots, padding rows dropped) or `HEADS` [1, kv_heads, max_context, head_dim]
(GroupQueryAttention's buffers, which the graph writes itself: `advance` only moves the length; a conv window
[1, width, channels], as the gqa_in_place graph's layers take rows: [1, ar, hidden]).
A batch's cache (batch_blocks, rows_of: runtime/scheduler.py) is one array per attention block
[layers, 2, n, kv_heads, max_context, head_dim] and per conv layer a window array [n, width, channels], sequence b's
cache a KVCache over row b of each.
Slots are not positions: `positions` [rope rows, max_context] keeps the rope positions each slot's row was computed
at (runtime/positions.py), so that the next token's position follows the kept rows after a rewind.
families/layers.py is the graph side; tests/test_kv_contract.py checks both.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..format.manifest import AttentionLayer, ConvLayer, KVSpec


def attention_mask(pos: int, ar: int, max_context: int, dtype=np.float32, out: np.ndarray | None = None,
                   neg: float | None = None) -> np.ndarray:
    """Additive mask [ar, max_context + ar] for a step whose first row goes to cache slot pos (slots, not rope
    positions: the mask says which slots hold rows).

    neg is the value of hidden slots: the dtype's lowest by default; quantized (HTP) graphs use a
    moderate value (manifest decoder.mask_value) so that the mask does not eat the 16-bit range."""
    neg = np.finfo(dtype).min if neg is None else neg
    m = out if out is not None else np.empty((ar, max_context + ar), dtype)
    m.fill(neg)
    m[:, :pos] = 0  # the cache holds slots 0..pos-1
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
    """The cache prefix [:ctx] a step at first slot pos reads from a graph with a symbolic cache length
    (manifest decoder.kind.context_step = step > 0): pos rounded up to a multiple of step, at least step, at most
    max_context. The prefix holds slots 0..pos-1."""
    return min(max_context, max(step, -(-pos // step) * step))


@dataclass(frozen=True)
class CacheLayout:
    """How an attention layer's K (or V) buffer is laid out; the decoder kind picks one (decoder_kinds.py)."""

    name: str
    shape: Callable[[AttentionLayer, int], tuple]  # (layer, max_context) -> one buffer's shape
    rows: Callable[[np.ndarray, int], np.ndarray]  # (block [layers, 2, *buffer], n) -> its slots 0..n-1 [layers, 2, n, dim]
    prefix: bool  # a step reads a buffer's prefix [:ctx] (else the whole buffer)
    # block -> its view [max_context, layers, 2, dim] by slot (a decode step's one-row write), where the host writes
    by_slot: Callable[[np.ndarray], np.ndarray | None]
    window: Callable[[ConvLayer], tuple]  # a conv layer's window shape (its rows': the same with ar for width)


ROWS = CacheLayout("rows", lambda layer, ctx: (ctx, layer.dim), lambda block, n: block[:, :, :n], True,
                   lambda block: block.transpose(2, 0, 1, 3), lambda layer: (layer.width, layer.channels))
HEADS = CacheLayout("heads", lambda layer, ctx: (1, layer.kv_heads, ctx, layer.head_dim),
                    lambda block, n: block[:, :, 0, :, :n].transpose(0, 1, 3, 2, 4).reshape(*block.shape[:2], n, -1),
                    False, lambda block: None,  # (the graph writes HEADS buffers itself)
                    lambda layer: (1, layer.width, layer.channels))


class AttentionBlock:
    """The buffers of the attention layers of one shape: data [layers, 2 (K, V), *buffer]; `layers` are their
    indices among the cache's attention layers (the order of kv.encodings' lists)."""

    def __init__(self, layers: list[int], specs: list[AttentionLayer], layout: CacheLayout, max_context: int, dtype,
                 data: np.ndarray | None = None):
        """data: the block's array (a sequence's rows of a batch's block, KVCache.rows_of); None: its own."""
        self.layers, self.specs, self.layout = layers, specs, layout
        self.data = zeroed((len(layers), 2, *layout.shape(specs[0], max_context)), dtype) if data is None else data
        self.by_slot = layout.by_slot(self.data)

    def staging(self, ar: int) -> np.ndarray:
        """A step's new rows [layers, 2, ar, dim] (ROWS)."""
        return np.zeros((len(self.layers), 2, ar, self.specs[0].dim), self.data.dtype)


class ConvRows:
    """One conv layer's rows: data [width + max_context, channels], slot s at row width + s (the width rows before
    slot 0 stay zero), and the window a step reads (the graph input, load_windows), in the layout's shape:
    [width, channels], or [1, width, channels] (a batch's call: [n, width, channels], n sequences' windows)."""

    def __init__(self, spec: ConvLayer, layout: CacheLayout, max_context: int, dtype, window: np.ndarray | None = None):
        """window: the window array (a sequence's row of a batch's window array, KVCache.rows_of); None: its own."""
        self.spec = spec
        self.data = zeroed((spec.width + max_context, spec.channels), dtype)
        self.window = np.zeros(layout.window(spec), dtype) if window is None else window

    def load(self, slot: int) -> None:
        self.window[...] = self.data[slot : slot + self.spec.width]  # slots slot - width .. slot - 1

    def staging(self, ar: int) -> np.ndarray:
        """A step's rows: [ar, channels], or with a window [n, width, channels] [n, ar / n, channels] (each
        sequence's ar / n rows: a batch's call)."""
        lead = self.window.shape[:-2]
        return np.zeros((*lead, ar // (lead[0] if lead else 1), self.spec.channels), self.data.dtype)


class KVCache:
    def __init__(self, spec: KVSpec, layout: CacheLayout = ROWS, dtype=None, rope_rows: int = 1,
                 blocks: list[np.ndarray] | None = None):
        """blocks: the attention blocks' arrays, then the conv windows' (KVCache.rows_of: a sequence's rows of a
        batch's cache, batch_blocks); None: allocated here."""
        self.spec, self.layout = spec, layout
        self.dtype = np.dtype(dtype or spec.dtype)
        self.max_context = spec.max_context
        attention = spec.attention()
        shapes: dict[tuple, list[int]] = {}
        for i, layer in enumerate(attention):
            shapes.setdefault(layout.shape(layer, spec.max_context), []).append(i)
        self.blocks = [AttentionBlock(ix, [attention[i] for i in ix], layout, spec.max_context, self.dtype,
                                      None if blocks is None else blocks[j])
                       for j, ix in enumerate(shapes.values())]
        convs = [layer for layer in spec.layers if isinstance(layer, ConvLayer)]
        windows = [None] * len(convs) if blocks is None else blocks[len(shapes):]
        if len(windows) != len(convs):
            raise ValueError(f"{len(windows)} conv windows given for {len(convs)} conv layers (KVCache.batch_blocks)")
        # attention layer i's K and V buffers (views of its block), in layer order
        at = {i: (b, j) for b in self.blocks for j, i in enumerate(b.layers)}
        self.keys = [at[i][0].data[at[i][1], 0] for i in range(len(attention))]
        self.values = [at[i][0].data[at[i][1], 1] for i in range(len(attention))]
        self.convs = [ConvRows(layer, layout, spec.max_context, self.dtype, w) for layer, w in zip(convs, windows)]
        # the graph inputs, in kv.layers order: (name, buffer, read as a prefix [:ctx]) — attention K / V buffers
        # (ROWS: a prefix), conv windows (whole)
        self._inputs: list[tuple[str, np.ndarray, bool]] = []
        a = c = 0
        for layer in spec.layers:
            if isinstance(layer, AttentionLayer):
                self._inputs += [(layer.key_input, self.keys[a], layout.prefix),
                                 (layer.value_input, self.values[a], layout.prefix)]
                a += 1
            else:
                self._inputs.append((layer.state_input, self.convs[c].window, False))
                c += 1
        self.positions = np.zeros((rope_rows, spec.max_context), np.int64)  # each slot's rope positions
        self._positions = memoryview(self.positions)  # (single items: the decode loop's)
        self.length = 0  # number of valid slots (= the next slot)
        self.epoch = 0  # counts resets: rows kept across calls (a prefix reuse) belong to one epoch
        # clear_unused's "clean from" mark: slots >= max(_written, length) were not written since the last clear and
        # each buffer's hold the byte _tail[kind][i] (np.zeros: 0). Rows land only at length.. (write), so a slot
        # is written past the kept length only when reset / rewind lowers the length: they raise _written first
        self._written = 0
        self._tail = {kind: [0.0] * len(attention) for kind in ("key", "value")}

    @staticmethod
    def batch_blocks(spec: KVSpec, n: int, dtype=None) -> list[np.ndarray]:
        """n sequences' HEADS caches: the attention blocks, one array per block [layers, 2, n, kv_heads, max_context,
        head_dim] (zeroed: its own mapping), then per conv layer its windows [n, width, channels]; sequence b's cache
        is KVCache(..., blocks=rows_of(.., b)), and a batched step binds each attention layer's [n, kv_heads,
        max_context, head_dim] and each conv layer's windows whole (runtime/scheduler.py)."""
        dtype = np.dtype(dtype or spec.dtype)
        shapes: dict[tuple, int] = {}
        for layer in spec.attention():
            key = HEADS.shape(layer, spec.max_context)
            shapes[key] = shapes.get(key, 0) + 1
        windows = [np.zeros((n, *HEADS.window(layer)[1:]), dtype) for layer in spec.layers if isinstance(layer, ConvLayer)]
        return [zeroed((count, 2, n, *shape[1:]), dtype) for shape, count in shapes.items()] + windows

    @staticmethod
    def rows_of(blocks: list[np.ndarray], b: int, stop: int | None = None) -> list[np.ndarray]:
        """Sequences b..stop-1's views (default: b's) of batch_blocks: the attention blocks' [layers, 2, 1,
        kv_heads, max_context, head_dim] and the conv windows' [1, width, channels] (each layer's buffer contiguous
        for one sequence: what a one-sequence step binds)."""
        stop = b + 1 if stop is None else stop
        return [x[:, :, b:stop] if x.ndim == 6 else x[b:stop] for x in blocks]  # (conv windows: [n, width, channels])

    @property
    def data(self) -> np.ndarray:
        """The attention block [layers, 2, *buffer] of a cache whose attention layers have one shape (today's
        families; tests look into it)."""
        if len(self.blocks) != 1:
            raise ValueError("this cache's attention layers have several shapes: see KVCache.blocks")
        return self.blocks[0].data

    @property
    def nbytes(self) -> int:
        return sum(b.data.nbytes for b in self.blocks) + sum(c.data.nbytes for c in self.convs)

    def next_position(self) -> int:
        """The rope position of a row after the kept ones: one past the largest of the last slot's positions (0 for
        an empty cache). With positions = slots (runtime/positions.py "slots") that is the length."""
        return self.position_after(self.length)

    def position_after(self, n: int) -> int:
        """The rope position of a row after slots 0..n-1 (n <= length)."""
        if not n:
            return 0
        if self.positions.shape[0] == 1:
            return self._positions[0, n - 1] + 1
        return int(self.positions[:, n - 1].max()) + 1

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
        """The state as graph inputs; ctx < max_context gives ROWS buffers' prefix [:ctx] (a contiguous view, no
        copy); HEADS buffers and conv states whole."""
        return {name: buf[:ctx] if prefix else buf for name, buf, prefix in self._inputs}

    def load_windows(self, slot: int) -> None:
        """The conv layers' windows (their graph inputs) for a step whose first row goes to slot."""
        for c in self.convs:
            c.load(slot)

    def inputs(self) -> list[tuple[str, np.ndarray, bool]]:
        """(graph input name, whole buffer, read as a prefix [:ctx]) of every layer's state, in kv.layers order."""
        return list(self._inputs)

    def stored(self, n: int | None = None) -> np.ndarray:
        """Attention rows 0..n-1 (default: the length) as [layers, 2, n, dim], whatever the layout (HEADS: a copy)."""
        n = self.length if n is None else n
        return self.layout.rows(self.data, n)

    def output_names(self) -> list[str]:
        return self.spec.state_outputs()

    def conv_staging(self, ar: int) -> list[np.ndarray]:
        """Per conv layer the buffer its step's rows land in, in its window's layout (ConvRows.staging: [1, ar,
        channels] for HEADS; a HEADS kind's only staging)."""
        return [c.staging(ar) for c in self.convs]

    def staging(self, ar: int) -> list[np.ndarray]:
        """The buffers a ROWS step's outputs land in: per attention block [layers, 2, ar, dim], then per conv layer
        [ar, channels] (write's `rows`)."""
        return [b.staging(ar) for b in self.blocks] + [c.staging(ar) for c in self.convs]

    def staged_outputs(self, staged: list[np.ndarray]) -> list[np.ndarray]:
        """The staging buffers by graph output, in output_names() order (attention: K then V)."""
        out, a, c = [], 0, 0
        where = {i: (bi, j) for bi, b in enumerate(self.blocks) for j, i in enumerate(b.layers)}
        for layer in self.spec.layers:
            if isinstance(layer, AttentionLayer):
                bi, j = where[a]
                out += [staged[bi][j, 0], staged[bi][j, 1]]
                a += 1
            else:
                out.append(staged[len(self.blocks) + c])
                c += 1
        return out

    def clear_unused(self, enc: dict) -> None:
        """Slots length.. of a uint8 cache hold 0 under enc (per layer (scale, zp) of K and V, and of conv rows: the
        rows before slot 0 of a conv layer, its window's zeros; the encoding of the
        graph that reads them next), i.e. byte zp. Byte 0 (np.zeros, or a stale row) reads back as -zp*scale in
        every dim: a key row whose score q.k/sqrt(d) on a real decoder (large-mean queries) is far above the
        -100 of an HTP mask, and a float (fp16) graph, which does not clip its scores to a calibrated range as a
        QDQ graph does, then attends to the hidden slot (measured: SmolLM2's fp16 prefill, top-1 0.61 -> 0.9+).
        Only what changed is written: the slots written since the last clear (up to the "clean from" mark), or the
        whole tail of a buffer whose zero point differs from the one its tail holds (prefill's vs decode's).
        ROWS buffers only (the HTP's; a HEADS graph writes rows past the length itself)."""
        n, end = self.length, max(self._written, self.length)
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                z, tail = enc[kind][i][1], self._tail[kind]
                if tail[i] != z:
                    buf[n:] = tail[i] = z
                elif n < end:
                    buf[n:end] = z
        for c, (_, z) in zip(self.convs, enc.get("conv", ())):  # a conv step reads slots before its own only: the
            c.data[: c.spec.width] = z  # rows before slot 0 are the ones no step writes
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
        for c, (s1, z1), (s2, z2) in zip(self.convs, src.get("conv", ()), dst.get("conv", ())):
            rows = c.data[c.spec.width : c.spec.width + n]
            rows[...] = np.clip(np.rint((rows.astype(np.float32) - z1) * (s1 / s2)) + z2, 0, 255).astype(np.uint8)
        self.clear_unused(dst)

    def _check_room(self, n_valid: int) -> None:
        if self.length + n_valid > self.max_context:
            raise OverflowError(f"KV cache full: {self.length} + {n_valid} > {self.max_context}")

    def keep_positions(self, positions: np.ndarray, n_valid: int) -> None:
        """positions [rows, >= n_valid]: the rope positions of the rows about to go to slots length.. ."""
        pos = self.length
        if n_valid == 1 and self.positions.shape[0] == 1:
            self._positions[0, pos] = positions[0, 0]
        else:
            self.positions[:, pos : pos + n_valid] = positions[:, :n_valid]

    def advance(self, n_valid: int, positions: np.ndarray) -> None:
        """A HEADS step's rows are in the buffers (the graph wrote them): keep their positions and move the length
        (rows it wrote beyond, a lookahead step's rejected drafts, are stale slots like any beyond the length)."""
        self._check_room(n_valid)
        self.keep_positions(positions, n_valid)
        self.length += n_valid

    def write(self, rows: list[np.ndarray], n_valid: int, positions: np.ndarray) -> None:
        """rows: a ROWS step's staging (staging()): store the first n_valid rows of each attention block and conv
        layer at slots length..length+n_valid-1 (padding rows are dropped), keep their positions [rows, ar], then
        advance the length."""
        pos = self.length
        self._check_room(n_valid)
        self.keep_positions(positions, n_valid)
        blocks = self.blocks
        if n_valid == 1:  # a decode step: one assignment per block (no slices)
            for b, r in zip(blocks, rows):
                b.by_slot[pos] = r.transpose(2, 0, 1, 3)[0]
        else:
            for b, r in zip(blocks, rows):
                b.data[:, :, pos : pos + n_valid] = r[:, :, :n_valid]
        self.write_convs(rows[len(blocks):], n_valid)
        self.length = pos + n_valid

    def write_convs(self, rows: list[np.ndarray], n_valid: int) -> None:
        """rows: per conv layer its step's rows [ar, channels] (or [1, ar, channels]: one sequence's, whatever the
        leading 1s); the first n_valid stored at slots length.. (the length is not moved: write / advance move it)."""
        pos = self.length
        for c, r in zip(self.convs, rows):
            w = c.spec.width
            c.data[w + pos : w + pos + n_valid] = r.reshape(-1, c.spec.channels)[:n_valid]
