"""The state kind of a recurrent layer (manifest kv.layers kind "recurrent": Qwen3.5's Gated DeltaNet), registered
beside state_kinds.py's attention and conv kinds.

Per layer two arrays summarize every slot before the next: the conv window [width, channels] (its causal conv's last
input rows) and the gated delta rule's state [heads, key_dim, value_dim]; gqa_in_place lays them out [1, ...] ([n,
...] for a batch of n sequences: each sequence's rows of one array, batch_axis 0). A step reads both as inputs and
returns them as they are after its last row into the staging (never in place: the arrays keep the state before the
call until `store` copies the step's in), so

  fewer rows than the call computed (a lookahead call's rejected drafts) cannot be kept: KVCache.drops_rows is False
      with such a state, so the cache row stores nothing of that call (the arrays still hold the state before it)
      and runs the kept rows again (CacheRow.verify: a replay, counted in the stats);
  an idle row of a batched call computes junk into its staging row, which nobody stores;
  keeping a prefix (rewind(n): prefix reuse, a reset) restores a snapshot of the arrays taken at slot n
      (checkpoint: the cache row takes one at the end of each prompt block, CacheRow.block); the KEEP most recent
      are kept (KEEP × nbytes of memory, the count and the time in `costs`), restorable(n) says which slots have one.

No state here is per slot, so a snapshot is the only way back: a rewind to a slot without one leaves the state
unusable until a reset or a restore (restorable never offers such a slot).
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ...format.errors import BundleError
from ...format.manifest import RecurrentLayer
from .cache_layouts import CacheLayout
from .state_kinds import Bind, register_state

KEEP = 8  # snapshots kept per sequence (the most recent)


def _shapes(layer: RecurrentLayer, layout: CacheLayout) -> tuple[tuple, tuple]:
    """(conv window, state) shapes in the layout: the conv window's as a conv layer's (CacheLayout.window), the
    state's with the same leading dims."""
    window = tuple(layout.window(layer))
    return window, (*window[:-2], layer.heads, layer.key_dim, layer.value_dim)


def _float(dtype) -> np.dtype:
    """The state's dtype: the cache's, but float32 under a uint8 cache (an HTP bundle's: its graphs take the
    recurrent state as float I/O, export/cache_kinds.py RecurrentCache.encoded)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "f" else np.dtype(np.float32)


@register_state
class RecurrentState:
    name = "recurrent"
    batch_axis = 0  # a batch's arrays [n, width, channels], [n, heads, key_dim, value_dim]
    loads_inputs = False  # a step reads the arrays themselves
    stores = True  # store copies the step's state in
    drops_rows = False  # a step's state cannot be kept in part (module doc)

    def __init__(self, layers: list[tuple[int, RecurrentLayer]], layout: CacheLayout, max_context: int, dtype,
                 arrays: Iterator[np.ndarray] | None = None):
        """arrays: each layer's conv window and state arrays in turn (a sequence's rows of a batch's); None: its own."""
        self.indices, self.specs = [i for i, _ in layers], [layer for _, layer in layers]
        dtype = _float(dtype)
        self.arrays_ = []
        for layer in self.specs:
            for shape in _shapes(layer, layout):
                self.arrays_.append(np.zeros(shape, dtype) if arrays is None else next(arrays))
        self.at = 0  # the slot the arrays are at (the state after slots 0..at-1); -1: unusable (module doc)
        self.snapshots: dict[int, list[np.ndarray]] = {}  # slot -> copies of the arrays there
        self.costs = {"snapshots": 0, "snapshot_s": 0.0, "restores": 0}

    @staticmethod
    def batch_arrays(layers: list[tuple[int, RecurrentLayer]], layout: CacheLayout, max_context: int, n: int,
                     dtype) -> list[np.ndarray]:
        """n sequences' arrays per layer: [n, width, channels], [n, heads, key_dim, value_dim]."""
        return [np.zeros((n, *shape[1:]), _float(dtype)) for _, layer in layers for shape in _shapes(layer, layout)]

    @property
    def arrays(self) -> list[np.ndarray]:
        return list(self.arrays_)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays_)

    def inputs(self) -> list[tuple[int, str, np.ndarray, bool]]:
        names = [n for layer in self.specs for n in layer.inputs]
        indices = [i for i in self.indices for _ in range(2)]
        return [(i, name, a, False) for i, name, a in zip(indices, names, self.arrays_)]

    def staging(self, ar: int) -> list[np.ndarray]:
        """Where a step's state lands: one array like each of this sequence's (or a batch's) arrays."""
        return [np.zeros_like(a) for a in self.arrays_]

    def bind(self, bind: Bind, bind_output: Bind, ctx: int, staged: list[np.ndarray]) -> None:
        names = [n for layer in self.specs for n in layer.inputs]
        outs = [n for layer in self.specs for n in layer.outputs]
        for name, a in zip(names, self.arrays_):
            bind(name, a)
        for name, s in zip(outs, staged):
            bind_output(name, s)

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        outs = [n for layer in self.specs for n in layer.outputs]
        for name, s in zip(outs, staged):
            s[...] = outputs[name]

    def keeps(self, pos: int, n: int, ar: int) -> bool:
        """A step is kept whole or not at all (module doc)."""
        return n == ar

    def store(self, staged: list[np.ndarray], pos: int, n: int) -> None:
        """The step's state after its last row replaces the arrays' (a step stored whole: KVCache.drops_rows is
        False, so the cache row never stores part of a step here, it runs the kept rows again)."""
        for a, s in zip(self.arrays_, staged):
            a[...] = s.reshape(a.shape)
        self.at = pos + n

    def checkpoint(self, n: int) -> None:
        """A snapshot of the arrays at slot n (the cache's length: where they are), the oldest dropped past KEEP."""
        if self.at != n or n in self.snapshots:
            return
        t = time.perf_counter()
        self.snapshots[n] = [a.copy() for a in self.arrays_]
        while len(self.snapshots) > KEEP:
            del self.snapshots[min(self.snapshots)]
        self.costs["snapshots"] += 1
        self.costs["snapshot_s"] += time.perf_counter() - t

    def restorable(self, n: int, step: int) -> int:
        """The largest slot <= n, a multiple of step, where the state can be had: where the arrays are, or a
        snapshot (0: the empty state)."""
        slots = [s for s in (*self.snapshots, self.at) if 0 <= s <= n and s % step == 0]
        return max(slots, default=0)

    def rewind(self, n: int) -> None:
        """The state after slots 0..n-1: zeros for 0, a snapshot's copy (snapshots past n dropped), unusable if there
        is none (restorable never offers such an n)."""
        for s in [s for s in self.snapshots if s > n]:
            del self.snapshots[s]
        if n == self.at:
            return
        if n == 0:
            for a in self.arrays_:
                a[...] = 0
            self.snapshots.clear()
        elif n in self.snapshots:
            for a, s in zip(self.arrays_, self.snapshots[n]):
                a[...] = s
            self.costs["restores"] += 1
        else:
            n = -1
        self.at = n

    def clear_unused(self, enc: dict, n: int, end: int) -> None:
        """(a float state only: no uint8 encoding of it)"""

    def requantize(self, src: dict, dst: dict, n: int) -> None:
        """(a float state only)"""

    @staticmethod
    def check_graph(layers: list[tuple[int, RecurrentLayer]], g, graph: str, layout: CacheLayout, max_context: int,
                    ctx: int | None, kind: str) -> None:
        """Each layer's conv window and state inputs in graph g have the layout's shapes."""
        from ..sessions import agree

        for i, layer in layers:
            for name, want in zip(layer.inputs, _shapes(layer, layout)):
                have = g.input(name).shape
                if not agree(have, list(want)):
                    raise BundleError(f"the manifest's kv.layers[{i}] (recurrent: width {layer.width}, channels "
                                      f"{layer.channels}, heads {layer.heads}, key_dim {layer.key_dim}, value_dim "
                                      f"{layer.value_dim}) does not fit graphs.{graph}'s input {name} {have} "
                                      f"(decoder kind {kind}: {list(want)})")
