"""The decoder's state by kind of cache layer: one class per manifest `kv.layers[i].kind`, registered by name.

    STATE_KINDS["attention"], STATE_KINDS["conv"]     # each: the state of every layer of its kind in one cache

KVCache (runtime/decode/kv_cache.py) is a container that loops over its kinds' state objects; a state kind is the one place
that knows how its state is
  allocated   for one sequence (__init__), or for B sequences of a batch (batch_arrays: each array's sequence axis is
              the kind's batch_axis; a sequence's cache is built over its rows of them, `arrays`)
  bound       to a step as the decoder kind's layout says (inputs; bind: a bound step's inputs / outputs; take: a
              plain step's outputs), its outputs landing in `staging(ar)` until `store`
  loaded      into a graph input before a call (load(slot) / loaders(), where loads_inputs; load_idle: a batch's idle row)
  stored      after a call (store(staged, pos, n): a step's first n rows at slots pos..; padding rows dropped)
  kept        for a prefix of n slots (rewind(n): prefix reuse, a rejected lookahead draft, a reset)
  re-encoded  in a uint8 cache (clear_unused, requantize: per layer (scale, zero point) in kv.encodings)
  checked     against a graph's inputs (check_graph: the manifest's numbers against the graph's shapes)
Both kinds hold one row per slot, so keeping a prefix is keeping its slots: rewind has nothing to restore (rows
beyond the length are stale, masked or never read, and overwritten by the next writes), and a step's first n rows
can be stored alone (drops_rows). A kind whose state is not per slot (runtime/decode/recurrent_state.py, "recurrent":
Qwen3.5's Gated DeltaNet) has drops_rows False and keeps snapshots (checkpoint, restorable, rewind).
  attention  a K and a V row per slot: slot s holds the (post-RoPE) key/value of the row written at slot s. Layers
             of one shape and dtype share one block [layers, 2 (K, V), *buffer] (a step's new rows land in all of them
             with one copy); layers of other widths get a block of their own. A layer's buffers are of its cache dtype
             (manifest AttentionLayer.cache_dtype: the I/O dtype, or its quantized cache's int8 / uint8 nibble pairs,
             [.., head_dim / 2] at 4 bits: AttentionLayer.cache_dim), which the graph quantizes and reads itself.
             Laid out ROWS [max_context, kv_dim] (the rows contract: a step reads all slots or a prefix [:ctx] and returns its new rows, which store writes) or HEADS
             [1, kv_heads, max_context, head_dim] (GroupQueryAttention's buffers, which the graph writes itself).
  conv       one row [channels] per slot of a short convolution's input, of which a step reads the `width` rows
             before its first slot (a window, load: [width, channels], or HEADS's [1, width, channels]) and returns
             its own rows ([ar, channels] / [1, ar, channels]), stored at its slots like K/V rows.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from ...format.errors import BundleError
from ...format.manifest import AttentionLayer, ConvLayer
from .cache_layouts import CacheLayout, zeroed

STATE_KINDS: dict[str, type] = {}

Bind = Callable[[str, np.ndarray], object]  # (graph tensor name, host array) -> the bound value (an OrtValue)


def register_state(cls: type) -> type:
    STATE_KINDS[cls.name] = cls
    return cls


class AttentionBlock:
    """The buffers of the attention layers of one shape: data [layers, 2 (K, V), *buffer]; `layers` are their
    indices among the cache's attention layers (the order of kv.encodings' lists)."""

    def __init__(self, layers: list[int], specs: list[AttentionLayer], layout: CacheLayout, max_context: int, dtype,
                 data: np.ndarray | None = None):
        """data: the block's array (a sequence's rows of a batch's block, KVCache.rows_of); None: its own. dtype: the
        cache's (kv.dtype); the block's is its layers' cache dtype (a quantized cache's int8 / uint8)."""
        self.layers, self.specs, self.layout = layers, specs, layout
        dtype = specs[0].cache_dtype(dtype)
        self.data = zeroed((len(layers), 2, *layout.shape(specs[0], max_context)), dtype) if data is None else data
        self.by_slot = layout.by_slot(self.data)

    def staging(self, ar: int) -> np.ndarray:
        """A step's new rows [layers, 2, ar, dim] (ROWS)."""
        return np.zeros((len(self.layers), 2, ar, self.specs[0].dim), self.data.dtype)


def _shapes(specs: list[AttentionLayer], layout: CacheLayout, max_context: int) -> dict[tuple, list[int]]:
    """(buffer shape, cache dtype) -> the attention layers (indices among them) of that shape and dtype, in order of
    first use."""
    shapes: dict[tuple, list[int]] = {}
    for i, layer in enumerate(specs):
        shapes.setdefault((layout.shape(layer, max_context), layer.cache_dtype("")), []).append(i)
    return shapes


@register_state
class AttentionState:
    name = "attention"
    batch_axis = 2  # a batch's block [layers, 2, n, kv_heads, max_context, head_dim]
    loads_inputs = False  # a step reads the buffers themselves
    drops_rows = True  # a store of a step's first n rows keeps what n steps of one row keep (rows are per slot)

    def __init__(self, layers: list[tuple[int, AttentionLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        """layers: (kv.layers index, entry) of each attention layer; arrays: the blocks' arrays (a sequence's rows of
        a batch's, taken in order), None: allocated here."""
        specs = [layer for _, layer in layers]
        self.layout, self.stores = layout, not layout.in_place
        self.blocks = [AttentionBlock(ix, [specs[i] for i in ix], layout, max_context, dtype,
                                      None if arrays is None else next(arrays))
                       for ix in _shapes(specs, layout, max_context).values()]
        # attention layer i's K and V buffers (views of its block), in layer order
        at = {i: (b, j) for b in self.blocks for j, i in enumerate(b.layers)}
        self.keys = [at[i][0].data[at[i][1], 0] for i in range(len(specs))]
        self.values = [at[i][0].data[at[i][1], 1] for i in range(len(specs))]
        self._where = [(self.blocks.index(at[i][0]), at[i][1]) for i in range(len(specs))]  # (block, row in it)
        self.specs, self.indices = specs, [index for index, _ in layers]
        # each buffer's tail (slots >= the cache's clean-from mark) holds this byte (clear_unused; np.zeros: 0)
        self._tail = {kind: [0.0] * len(specs) for kind in ("key", "value")}

    @staticmethod
    def batch_arrays(layers: list[tuple[int, AttentionLayer]], layout: CacheLayout, max_context: int, n: int,
                     dtype) -> list[np.ndarray]:
        """n sequences' blocks, one array per block [layers, 2, n, *buffer[1:]] (zeroed: its own mapping; the layout's
        leading 1 is the sequence axis)."""
        specs = [layer for _, layer in layers]
        return [zeroed((len(ix), 2, n, *shape[1:]), specs[ix[0]].cache_dtype(dtype))
                for (shape, _), ix in _shapes(specs, layout, max_context).items()]

    @property
    def arrays(self) -> list[np.ndarray]:
        return [b.data for b in self.blocks]

    @property
    def nbytes(self) -> int:
        return sum(b.data.nbytes for b in self.blocks)

    def inputs(self) -> list[tuple[int, str, np.ndarray, bool]]:
        """(kv.layers index, graph input, whole buffer, read as a prefix [:ctx]) of each K and V buffer."""
        p = self.layout.prefix
        return [x for index, layer, k, v in zip(self.indices, self.specs, self.keys, self.values)
                for x in ((index, layer.key_input, k, p), (index, layer.value_input, v, p))]

    def staging(self, ar: int) -> list[np.ndarray]:
        """Where a step's new rows land: per block [layers, 2, ar, dim] (ROWS); none where the graph writes the
        buffers itself (HEADS)."""
        return [b.staging(ar) for b in self.blocks] if self.stores else []

    def _staged(self, staged: list[np.ndarray]):
        """(output name, staging view) of each K and V output (ROWS)."""
        for layer, (bi, j) in zip(self.specs, self._where):
            yield layer.key_output, staged[bi][j, 0]
            yield layer.value_output, staged[bi][j, 1]

    def bind(self, bind: Bind, bind_output: Bind, ctx: int, staged: list[np.ndarray]) -> None:
        """The buffers as a bound step's inputs (ROWS: prefixes [:ctx], contiguous, no copy) and the step's new rows
        into the staging; HEADS: each buffer bound as input and output (one OrtValue), the graph updates it in place."""
        if not self.stores:
            for layer, k, v in zip(self.specs, self.keys, self.values):
                bind_output(layer.key_output, bind(layer.key_input, k))
                bind_output(layer.value_output, bind(layer.value_input, v))
            return
        for _, name, buf, prefix in self.inputs():
            bind(name, buf[:ctx] if prefix else buf)
        for name, buf in self._staged(staged):
            bind_output(name, buf)

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        """A plain step's outputs: ROWS, the new rows into the staging; HEADS, the whole updated buffers, of which the
        step's slots are taken."""
        if self.stores:
            for name, buf in self._staged(staged):
                buf[...] = outputs[name]
            return
        for layer, k, v in zip(self.specs, self.keys, self.values):
            k[..., slot : slot + ar, :] = outputs[layer.key_output][..., slot : slot + ar, :]
            v[..., slot : slot + ar, :] = outputs[layer.value_output][..., slot : slot + ar, :]

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        """The first n rows of each block's staging at slots pos..pos+n-1 (ROWS; padding rows dropped)."""
        if n == 1:  # a decode step: one assignment per block (no slices)
            for b, r in zip(self.blocks, staged):
                b.by_slot[pos] = r.transpose(2, 0, 1, 3)[0]
        else:
            for b, r in zip(self.blocks, staged):
                b.data[:, :, pos : pos + n] = r[:, :, :n]

    def rewind(self, n: int) -> None:
        """Keeping slots 0..n-1 is keeping their rows: nothing to restore."""

    @property
    def data(self) -> np.ndarray:
        """The block [layers, 2, *buffer] where the attention layers have one shape (today's families)."""
        if len(self.blocks) != 1:
            raise ValueError("this cache's attention layers have several shapes: see KVCache.blocks")
        return self.blocks[0].data

    def stored(self, n: int) -> np.ndarray:
        """Rows 0..n-1 as [layers, 2, n, dim], whatever the layout (HEADS: a copy)."""
        return self.layout.rows(self.data, n)

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        """Slots n.. of each uint8 buffer hold its zero point under enc["key"][i] / enc["value"][i]: the slots written
        since the last clear (n..end), or the whole tail of a buffer whose zero point differs from the one its tail
        holds (KVCache.clear_unused)."""
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                z, tail = enc[kind][i][1], self._tail[kind]
                if tail[i] != z:
                    buf[n:] = tail[i] = z
                elif n < end:
                    buf[n:end] = z

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        """Rows 0..n-1 of each uint8 buffer from encoding src into dst (KVCache.requantize)."""
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                (s1, z1), (s2, z2) = src[kind][i], dst[kind][i]
                if s1 == s2 and z1 == z2:
                    continue
                x = (buf[:n].astype(np.float32) - z1) * (s1 / s2)
                buf[:n] = np.clip(np.rint(x) + z2, 0, 255).astype(np.uint8)

    @staticmethod
    def check_graph(layers: list[tuple[int, AttentionLayer]], g, graph: str, layout: CacheLayout, max_context: int,
                    ctx: int | None, kind: str) -> None:
        """Each layer's K / V input in graph g has the layout's shape at cache length ctx (None: symbolic)."""
        from ..sessions import agree

        for i, (_, layer) in enumerate(layers):
            want = list(layout.shape(layer, ctx))
            for t in (layer.key_input, layer.value_input):
                have = g.input(t).shape
                if not agree(have, want):
                    raise BundleError(f"the manifest's kv (max_context {max_context}, attention layer {i}: "
                                      f"kv_heads {layer.kv_heads}, head_dim {layer.head_dim}) does not fit "
                                      f"graphs.{graph}'s cache input {t} {have}")


class ConvRows:
    """One conv layer's rows: data [width + max_context, channels], slot s at row width + s (the width rows before
    slot 0 stay zero), and the window a step reads (the graph input, load), in the layout's shape:
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


@register_state
class ConvState:
    name = "conv"
    batch_axis = 0  # a batch's windows [n, width, channels]
    loads_inputs = True  # each step's window is copied from the rows before its slot
    stores = True
    drops_rows = True

    def __init__(self, layers: list[tuple[int, ConvLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        """arrays: each layer's window array (a sequence's row of a batch's), taken in order; None: its own."""
        self.indices = [index for index, _ in layers]
        self.rows = [ConvRows(layer, layout, max_context, dtype, None if arrays is None else next(arrays))
                     for _, layer in layers]

    @staticmethod
    def batch_arrays(layers: list[tuple[int, ConvLayer]], layout: CacheLayout, max_context: int, n: int,
                     dtype) -> list[np.ndarray]:
        """n sequences' windows per layer [n, *window[1:]] (the layout's leading 1 is the sequence axis)."""
        return [np.zeros((n, *layout.window(layer)[1:]), dtype) for _, layer in layers]

    @property
    def arrays(self) -> list[np.ndarray]:
        return [c.window for c in self.rows]

    @property
    def nbytes(self) -> int:
        return sum(c.data.nbytes for c in self.rows)

    def inputs(self) -> list[tuple[int, str, np.ndarray, bool]]:
        return [(index, c.spec.state_input, c.window, False) for index, c in zip(self.indices, self.rows)]

    def staging(self, ar: int) -> list[np.ndarray]:
        """Per layer the buffer its step's rows land in, in its window's layout (ConvRows.staging)."""
        return [c.staging(ar) for c in self.rows]

    def bind(self, bind: Bind, bind_output: Bind, ctx: int, staged: list[np.ndarray]) -> None:
        for c, out in zip(self.rows, staged):
            bind(c.spec.state_input, c.window)
            bind_output(c.spec.state_output, out)

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        for c, buf in zip(self.rows, staged):
            buf[...] = outputs[c.spec.state_output]

    def load(self, slot: int) -> None:
        """The windows for a step whose first row goes to slot."""
        for c in self.rows:
            c.load(slot)

    def loaders(self) -> list:
        """Each layer's load(slot) (a bound step calls them before each call: one call a layer, no loop around)."""
        return [c.load for c in self.rows]

    def load_idle(self) -> None:
        """A batch's idle row: zero windows (its rows out are dropped)."""
        for c in self.rows:
            c.window[...] = 0

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        """Per layer its step's rows [ar, channels] (or [1, ar, channels]: one sequence's, whatever the leading 1s);
        the first n at slots pos.. ."""
        for c, r in zip(self.rows, staged):
            w = c.spec.width
            c.data[w + pos : w + pos + n] = r.reshape(-1, c.spec.channels)[:n]

    def rewind(self, n: int) -> None:
        """Keeping slots 0..n-1 is keeping their rows (the next window is read from them): nothing to restore."""

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        """The rows before slot 0 (a first step's window, the ones no step writes) hold enc["conv"][i]'s zero point
        (a conv step reads slots before its own only)."""
        for c, (_, z) in zip(self.rows, enc.get("conv", ())):
            c.data[: c.spec.width] = z

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        for c, (s1, z1), (s2, z2) in zip(self.rows, src.get("conv", ()), dst.get("conv", ())):
            rows = c.data[c.spec.width : c.spec.width + n]
            rows[...] = np.clip(np.rint((rows.astype(np.float32) - z1) * (s1 / s2)) + z2, 0, 255).astype(np.uint8)

    @staticmethod
    def check_graph(layers: list[tuple[int, ConvLayer]], g, graph: str, layout: CacheLayout, max_context: int,
                    ctx: int | None, kind: str) -> None:
        """Each layer's window input in graph g has the layout's window shape."""
        from ..sessions import agree

        for i, layer in layers:
            want = list(layout.window(layer))
            have = g.input(layer.state_input).shape
            if not agree(have, want):
                raise BundleError(f"the manifest's kv.layers[{i}] (conv: width {layer.width}, channels "
                                  f"{layer.channels}) does not fit graphs.{graph}'s input {layer.state_input} "
                                  f"{have} (decoder kind {kind}'s window: {want}; re-export a bundle made "
                                  "before it)")


def by_kind(layers: list) -> dict[str, list[tuple[int, object]]]:
    """kv.layers grouped by kind, the kinds in STATE_KINDS' order: name -> [(kv.layers index, entry), ...]."""
    groups: dict[str, list] = {name: [] for name in STATE_KINDS}
    for i, layer in enumerate(layers):
        groups[layer.kind].append((i, layer))
    return {name: group for name, group in groups.items() if group}
