"""Gemma 4's layer states beside the attention state (runtime/decode/state_kinds.py), registered by name:

  windowed_attention  a sliding-window layer (a query at slot q sees the keys at slots q - window < k <= q) in a
                      windowed cache (manifest WindowedAttentionLayer; gqa_in_place graphs: ORT's GroupQueryAttention
                      with sliding_window_cache): each K / V buffer holds `capacity` rows, after t slots rows
                      [0, L(t)) hold slots first(t) .. t - 1 (first(t) = t - L(t); the op evicts G = capacity -
                      window + 1 rows at once, so first(t) moves once every G slots). Memory and step cost do not
                      grow with the context. Below.
  sliding_attention   the same layer with K and V rows by slot, as an attention layer's, the graph applying the
                      window in its mask: the rows kinds (static graphs, --attention portable, the browser). Every
                      rewind is a move of the length.
  shared_kv           a layer that reads an earlier layer's K and V (manifest SharedKVLayer.source) inside the graph:
                      no state, no graph input or output of its own; nothing to store, load or rewind.

The windowed cache, as the recurrent state (runtime/decode/recurrent_state.py) is kept:
  a step reads the buffers and writes its present into a staging buffer (never in place), so the buffers keep the
      state before the call until `store` copies the step's in: only the rows the step added while first() stayed
      (its own rows), all L(t) rows where it moved (once every G slots). A kv-shared layer's node reads its source's
      buffers as they were before the step, as the source's node did (in place, the source's eviction would have
      moved them under it).
  a prefix of n slots (rewind(n): prefix reuse, a rejected lookahead draft, a reset) is exact without a copy where
      first(n) == first(t) for the slots t the buffers hold (rows [0, L(n)) are then the same rows): the length
      moves, nothing else. Else the rows it needs were evicted: a snapshot taken before they were restores them
      (a copy of the buffers), or there is none and the state is unusable until a reset (restorable never offers
      such an n).
  snapshots: a prompt block's end (KVCache.checkpoint) only marks its slot wanted; the copy is taken when a store
      would move first() past it (at most one per G slots, the KEEP = 2 most recent kept: decode steps mark none, so
      the last prompt's end survives its answer): a follow-up turn keeping that prefix restores it; an earlier
      block end whose copy was dropped is not offered (restorable: a shorter prefix, or none). Counted
      (snapshots, snapshot_s, restores) in `costs`, as the recurrent state's.
  a lookahead call whose rejected drafts leave n of its rows: keeps(n) says whether first(pos + n) == first(pos +
      ar) (the staging then holds the n rows' layout: stored as is); else KVCache.drops_rows is False's path:
      nothing of the call is stored and CacheRow.verify runs the kept rows again (a replay, in the stats).
  a batch (KVCache.batch_blocks): each layer's K and V [n, kv_heads, capacity, head_dim], sequence b's rows its
      window (the op's layout is per batch entry: ragged lengths); an idle row's junk step lands in the staging,
      which nobody stores.
  a quantized cache (`--kv-cache int8`, manifest AttentionLayer.quant): the buffers, the staging and the snapshots
      are the op's int8 rows (4-bit: uint8 nibble pairs), quantized and read back by the graph under scales that are
      constants of it, so every copy above moves the same bytes a fresh run would hold: nothing else changes.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ...format.errors import BundleError
from ...format.manifest import SharedKVLayer, WindowedAttentionLayer
from .cache_layouts import CacheLayout
from .state_kinds import AttentionState, Bind, register_state

KEEP = 2  # snapshots kept per sequence (the most recent: a follow-up turn keeps the last prompt's end; each is the
# buffers' size, so more would give back what the window saves: docs/gemma4.md)


@register_state
class SlidingAttentionState(AttentionState):
    """An attention state (blocks by shape, bound and stored by the layout) of the sliding-window layers by slot: the
    window is the graph's, so storing, rewinding and batching are the attention state's."""

    name = "sliding_attention"

    @staticmethod
    def _own(enc: dict) -> dict:
        """A uint8 cache's encodings of these layers: kv.encodings' "sliding_key" / "sliding_value" lists
        (export/cache_kinds.py), apart from the attention layers' "key" / "value"."""
        return {"key": enc.get("sliding_key", []), "value": enc.get("sliding_value", [])}

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        super().clear_unused(self._own(enc), n, end)

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        super().requantize(self._own(src), self._own(dst), n)


@register_state
class WindowedAttentionState:
    name = "windowed_attention"
    batch_axis = 0  # a batch's buffers [n, kv_heads, capacity, head_dim], per layer K and V
    loads_inputs = False  # a step reads the buffers themselves
    stores = True  # store copies the step's rows in from the staging
    drops_rows = False  # a step's first rows alone: where keeps() says so (module doc)

    def __init__(self, layers: list[tuple[int, WindowedAttentionLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        """arrays: each layer's K and V buffers in turn (a sequence's rows of a batch's); None: its own."""
        if not layout.in_place:
            raise BundleError("windowed_attention layers are a gqa_in_place graph's cache")
        self.indices, self.specs = [i for i, _ in layers], [layer for _, layer in layers]
        self.buffers = [np.zeros(self._shape(layer, 1), layer.cache_dtype(dtype)) if arrays is None
                        else next(arrays) for layer in self.specs for _ in range(2)]
        self._layer = [layer for layer in self.specs for _ in range(2)]  # each buffer's layer
        self._shapes = list({(layer.capacity, layer.window): layer for layer in self.specs}.values())
        self.at = 0  # the buffers hold the state after slots 0..at-1 (the cache's length); -1: unusable
        self.wanted: list[int] = []  # prompt block ends (checkpoint) not yet copied
        self.snapshots: list[tuple[int, int, list[np.ndarray]]] = []  # (lowest, highest slot it restores, copies)
        self.costs = {"snapshots": 0, "snapshot_s": 0.0, "restores": 0}
        self._staging: list[np.ndarray] | None = None

    @staticmethod
    def batch_arrays(layers: list[tuple[int, WindowedAttentionLayer]], layout: CacheLayout, max_context: int, n: int,
                     dtype) -> list[np.ndarray]:
        """n sequences' buffers per layer, K and V: [n, kv_heads, capacity, head_dim]."""
        return [np.zeros(WindowedAttentionState._shape(layer, n), layer.cache_dtype(dtype)) for _, layer in layers
                for _ in range(2)]

    @staticmethod
    def _shape(layer: WindowedAttentionLayer, n: int) -> tuple[int, ...]:
        """n sequences' K (or V) buffer of a layer: [n, kv_heads, capacity, head_dim] in its cache dtype (a quantized
        cache's int8 rows, or 4-bit nibble pairs [.., head_dim / 2]: manifest AttentionLayer.cache_dim)."""
        return n, layer.kv_heads, layer.capacity, layer.cache_dim

    @property
    def arrays(self) -> list[np.ndarray]:
        return list(self.buffers)

    @property
    def nbytes(self) -> int:
        """The buffers and the snapshots kept."""
        return sum(b.nbytes for b in self.buffers) + sum(c.nbytes for *_, copies in self.snapshots for c in copies)

    def _names(self, outputs: bool) -> list[str]:
        return [n for layer in self.specs for n in (layer.outputs if outputs else layer.inputs)]

    def inputs(self) -> list[tuple[int, str, np.ndarray, bool]]:
        indices = [i for i in self.indices for _ in range(2)]
        return [(i, name, b, False) for i, name, b in zip(indices, self._names(False), self.buffers)]

    def staging(self, ar: int) -> list[np.ndarray]:
        """Where a step's present buffers land: one like each buffer of this sequence's (or a batch's), whatever the
        AR (one set per state: steps never run at once, and a store reads the last call's)."""
        if self._staging is None:
            self._staging = [np.zeros_like(b) for b in self.buffers]
        return self._staging

    def bind(self, bind: Bind, bind_output: Bind, ctx: int, staged: list[np.ndarray]) -> None:
        for name, b in zip(self._names(False), self.buffers):
            bind(name, b)
        for name, s in zip(self._names(True), staged):
            bind_output(name, s)

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        for name, s in zip(self._names(True), staged):
            s[...] = outputs[name]

    # --- which counts share their rows ---
    def _same(self, a: int, b: int) -> bool:
        """Whether the buffers after a slots and after b slots hold the same first slot (in every layer shape)."""
        return all(layer.first(a) == layer.first(b) for layer in self._shapes)

    def _lowest(self, t: int) -> int:
        """The smallest count whose rows the buffers after t slots hold (manifest WindowedAttentionLayer.lowest)."""
        return max(layer.lowest(t) for layer in self._shapes)

    def keeps(self, pos: int, n: int, ar: int) -> bool:
        """Whether a step of ar rows at slot pos can keep its first n (store): its staging's rows then hold them."""
        return n == ar or self._same(pos + n, pos + ar)

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        """The step's staging (its first n rows kept: keeps) into the buffers: its own rows where first() stayed,
        every row where it moved (a snapshot taken first where a wanted block end would be lost)."""
        if self.at != pos:
            raise ValueError(f"a windowed cache at slot {self.at} cannot store a step at slot {pos}")
        t = pos + n
        same = self._same(pos, t)
        if not same and any(w >= self._lowest(pos) for w in self.wanted):
            self._snapshot(pos)
        for b, s, layer in zip(self.buffers, staged, self._layer):
            lo, hi = (layer.resident(pos) if same else 0), layer.resident(t)
            b[..., lo:hi, :] = s.reshape(b.shape)[..., lo:hi, :]
        self.at = t

    def _snapshot(self, t: int) -> None:
        """A copy of the buffers after t slots (restores lowest(t) .. t), the oldest dropped past KEEP."""
        c0 = time.perf_counter()
        self.snapshots.append((self._lowest(t), t, [b.copy() for b in self.buffers]))
        del self.snapshots[:-KEEP]
        self.wanted = [w for w in self.wanted if w < self._lowest(t)]
        self.costs["snapshots"] += 1
        self.costs["snapshot_s"] += time.perf_counter() - c0

    def checkpoint(self, n: int) -> None:
        """Slot n (the cache's length, a prompt block's end) is wanted: copied before a store evicts its rows."""
        if self.at == n and n not in self.wanted:
            self.wanted = [*self.wanted, n][-KEEP:]

    def restorable(self, n: int, step: int) -> int:
        """The largest slot <= n, a multiple of step, whose rows can be had: from the buffers (lowest(at) .. at) or a
        snapshot (its range); 0: the empty state."""
        sources = [(lo, hi) for lo, hi, _ in self.snapshots]
        if self.at >= 0:
            sources.append((self._lowest(self.at), self.at))
        best = 0
        for lo, hi in sources:
            m = min(n, hi)
            m -= m % step
            if m >= lo:
                best = max(best, m)
        return best

    def rewind(self, n: int) -> None:
        """The state after slots 0..n-1: the buffers as they are where they hold its rows (a move of the length),
        else a snapshot's copy; unusable (-1) where neither has (restorable never offers such an n). Snapshots and
        wanted slots past n keep only what is before n."""
        self.wanted = [w for w in self.wanted if w <= n]
        self.snapshots = [(lo, min(hi, n), c) for lo, hi, c in self.snapshots if lo <= n]
        if n == 0:
            self.at, self.snapshots = 0, []
            return
        if 0 <= self.at and self._lowest(self.at) <= n <= self.at:
            self.at = n
            return
        src = next((c for lo, hi, c in reversed(self.snapshots) if lo <= n <= hi), None)
        if src is None:
            self.at = -1
            return
        for b, c in zip(self.buffers, src):
            b[...] = c
        self.at = n
        self.costs["restores"] += 1

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        """(no uint8 HTP cache: the graph reads rows [0, L) only, whatever its dtype)"""

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        """(no uint8 HTP cache: a quantized cache's scales are constants of the graph)"""

    @staticmethod
    def check_graph(layers: list[tuple[int, WindowedAttentionLayer]], g, graph: str, layout: CacheLayout,
                    max_context: int, ctx: int | None, kind: str) -> None:
        """Each layer's K / V input in graph g is [batch, kv_heads, capacity, head_dim]."""
        from ..sessions import agree

        for i, layer in layers:
            want = list(WindowedAttentionState._shape(layer, 1))
            for t in layer.inputs:
                have = g.input(t).shape
                if not agree(have, want):
                    raise BundleError(f"the manifest's kv.layers[{i}] (windowed_attention: kv_heads {layer.kv_heads}, "
                                      f"head_dim {layer.head_dim}, capacity {layer.capacity}) does not fit "
                                      f"graphs.{graph}'s input {t} {have}")


@register_state
class SharedKVState:
    name = "shared_kv"
    batch_axis = 0
    loads_inputs = False
    stores = False
    drops_rows = True  # (no rows of its own: its source's are per slot)

    def __init__(self, layers: list[tuple[int, SharedKVLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        self.indices = [index for index, _ in layers]

    @staticmethod
    def batch_arrays(layers, layout: CacheLayout, max_context: int, n: int, dtype) -> list[np.ndarray]:
        return []

    arrays: list[np.ndarray] = []
    nbytes = 0

    def inputs(self) -> list:
        return []

    def staging(self, ar: int) -> list[np.ndarray]:
        return []

    def bind(self, bind, bind_output, ctx: int, staged: list[np.ndarray]) -> None:
        pass

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        pass

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        pass

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        pass

    @staticmethod
    def check_graph(layers, g, graph: str, layout: CacheLayout, max_context: int, ctx: int | None, kind: str) -> None:
        """Nothing of its own in the graph; the source layer's inputs are checked as that layer's."""

