"""The decoder's state outside the graphs: a container of its state kinds' objects (runtime/decode/state_kinds.py).

The manifest's `kv.layers` lists one entry per decoder layer, by kind (manifest.CACHE_LAYER_KINDS), and this cache
is built from that list alone: one state object per kind present (state_kinds.STATE_KINDS[kind], holding every layer
of that kind), so a family with mixed layers needs no scheduler change, and a new kind of state is one registered class.
The cache loops over its states to allocate, bind, load, store, keep a prefix and re-encode; what the states share is
here: the length (slots 0..length-1 hold rows), each slot's rope positions, and the slots' bookkeeping.
How a buffer is laid out is the decoder kind's (runtime/decode/decoder_kinds.py picks a cache_layouts.CacheLayout): `ROWS`
[max_context, kv_dim] (the rows contract: a step reads all slots or the prefix `context_slots` gives, masked so that
slots < the step's first slot are visible and its own rows see each other causally, and returns its new rows, which
`store` writes at the next slots, padding rows dropped) or `HEADS` [1, kv_heads, max_context, head_dim]
(GroupQueryAttention's buffers, which the graph writes itself: `store` writes the conv rows and moves the length).
A batch's cache (batch_blocks, rows_of: runtime/decode/scheduler.py) is each state kind's batch arrays (attention: one
per block [layers, 2, n, kv_heads, max_context, head_dim]; conv: a window array [n, width, channels] per layer),
sequence b's cache a KVCache over row b of each.
Slots are not positions: `positions` [rope rows, max_context] keeps the rope positions each slot's row was computed
at (runtime/prompt/positions.py), so that the next token's position follows the kept rows after a rewind.
families/layers.py is the graph side; tests/test_kv_contract.py checks both.
"""

from __future__ import annotations

import numpy as np

from ...format.manifest import KVSpec
from . import recurrent_state  # noqa: F401  (registers the "recurrent" state kind)
from .cache_layouts import HEADS, ROWS, CacheLayout, zeroed
from . import windowed_state  # noqa: F401  (registers the windowed_attention, sliding_attention and shared_kv kinds)
from .state_kinds import STATE_KINDS, by_kind

__all__ = ["HEADS", "ROWS", "BatchArrays", "CacheLayout", "KVCache", "attention_mask", "context_slots", "zeroed"]


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


def context_slots(pos: int, step: int, max_context: int) -> int:
    """The cache prefix [:ctx] a step at first slot pos reads from a graph with a symbolic cache length
    (manifest decoder.kind.context_step = step > 0): pos rounded up to a multiple of step, at least step, at most
    max_context. The prefix holds slots 0..pos-1."""
    return min(max_context, max(step, -(-pos // step) * step))


class BatchArrays(list):
    """A batch's cache arrays (KVCache.batch_blocks: each state kind's, in STATE_KINDS order) and, per array, the axis
    of its sequences (the kind's batch_axis), by which rows_of takes a sequence's rows."""

    def __init__(self, arrays, axes: list[int]):
        super().__init__(arrays)
        self.axes = axes


class _Given:
    """The arrays a cache is built over (a sequence's rows of a batch's), taken in turn by its states (next)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.taken = arrays, 0

    def __next__(self) -> np.ndarray:
        if self.taken == len(self.arrays):
            raise ValueError(f"{len(self.arrays)} state arrays given for a cache of more (KVCache.batch_blocks)")
        self.taken += 1
        return self.arrays[self.taken - 1]

    def done(self) -> None:
        if self.taken != len(self.arrays):
            raise ValueError(f"{len(self.arrays)} state arrays given for a cache of {self.taken} (KVCache.batch_blocks)")


class KVCache:
    def __init__(self, spec: KVSpec, layout: CacheLayout = ROWS, dtype=None, rope_rows: int = 1,
                 blocks: list[np.ndarray] | None = None):
        """blocks: the state kinds' arrays (KVCache.rows_of: a sequence's rows of a batch's cache, batch_blocks);
        None: allocated here."""
        self.spec, self.layout = spec, layout
        self.dtype = np.dtype(dtype or spec.dtype)
        self.max_context = spec.max_context
        given = None if blocks is None else _Given(blocks)
        # name -> the state of every layer of that kind (STATE_KINDS order)
        self.states = {name: STATE_KINDS[name](layers, layout, spec.max_context, self.dtype, given)
                       for name, layers in by_kind(spec.layers).items()}
        if given is not None:
            given.done()
        self._states = list(self.states.values())
        # each state's part of a step's staging list (staging()): (state, first, stop)
        self._parts, at = [], 0
        for st in self._states:
            n = len(st.staging(1))
            self._parts.append((st, at, at + n))
            at += n
        # the states that store a step's rows, each with its part of the staging (None: the whole list, no slice)
        self._storing = [(st.store, None if (lo, hi) == (0, at) else slice(lo, hi)) for st, lo, hi in self._parts
                         if st.stores]
        self._loading = [s for s in self._states if s.loads_inputs]  # states copied into an input before each call
        # states that cannot keep a step's first rows alone nor a prefix by its slots (a recurrent layer's): they
        # keep snapshots (checkpoint, restorable) and a step is stored whole or not at all (drops_rows)
        self._snapshotting = [s for s in self._states if not s.drops_rows]
        self.drops_rows = not self._snapshotting
        # the graph inputs, in kv.layers order: (name, buffer, read as a prefix [:ctx])
        self._inputs = [x[1:] for x in sorted((x for s in self._states for x in s.inputs()), key=lambda x: x[0])]
        self.positions = np.zeros((rope_rows, spec.max_context), np.int64)  # each slot's rope positions
        self._positions = memoryview(self.positions)  # (single items: the decode loop's)
        self._one_row = rope_rows == 1
        self.length = 0  # number of valid slots (= the next slot)
        self.epoch = 0  # counts resets: rows kept across calls (a prefix reuse) belong to one epoch
        # clear_unused's "clean from" mark: slots >= max(_written, length) were not written since the last clear and
        # each buffer's hold its tail byte (the state's; np.zeros: 0). Rows land only at length.. (store), so a slot
        # is written past the kept length only when reset / rewind lowers the length: they raise _written first
        self._written = 0

    @staticmethod
    def batch_blocks(spec: KVSpec, n: int, dtype=None) -> BatchArrays:
        """n sequences' HEADS caches: each state kind's batch arrays (attention: one per block [layers, 2, n,
        kv_heads, max_context, head_dim], zeroed: its own mapping; conv: per layer its windows [n, width, channels]);
        sequence b's cache is KVCache(..., blocks=rows_of(.., b)), and a batched step binds each attention layer's [n,
        kv_heads, max_context, head_dim] and each conv layer's windows whole (runtime/decode/scheduler.py)."""
        dtype = np.dtype(dtype or spec.dtype)
        arrays, axes = [], []
        for name, layers in by_kind(spec.layers).items():
            kind = STATE_KINDS[name]
            got = kind.batch_arrays(layers, HEADS, spec.max_context, n, dtype)
            arrays += got
            axes += [kind.batch_axis] * len(got)
        return BatchArrays(arrays, axes)

    @staticmethod
    def rows_of(blocks: BatchArrays, b: int, stop: int | None = None) -> BatchArrays:
        """Sequences b..stop-1's views (default: b's) of batch_blocks: the attention blocks' [layers, 2, 1,
        kv_heads, max_context, head_dim] and the conv windows' [1, width, channels] (each layer's buffer contiguous
        for one sequence: what a one-sequence step binds)."""
        stop = b + 1 if stop is None else stop
        return BatchArrays([x[(slice(None),) * axis + (slice(b, stop),)] for x, axis in zip(blocks, blocks.axes)],
                           blocks.axes)

    # --- what tests and benchmarks look into: the attention state's buffers ---
    @property
    def blocks(self) -> list:
        return self.states["attention"].blocks

    @property
    def keys(self) -> list[np.ndarray]:
        return self.states["attention"].keys

    @property
    def values(self) -> list[np.ndarray]:
        return self.states["attention"].values

    @property
    def data(self) -> np.ndarray:
        """The attention block [layers, 2, *buffer] of a cache whose attention layers have one shape (today's
        families; tests look into it)."""
        return self.states["attention"].data

    def stored(self, n: int | None = None) -> np.ndarray:
        """Attention rows 0..n-1 (default: the length) as [layers, 2, n, dim], whatever the layout (HEADS: a copy)."""
        return self.states["attention"].stored(self.length if n is None else n)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states)

    def next_position(self) -> int:
        """The rope position of a row after the kept ones: one past the largest of the last slot's positions (0 for
        an empty cache). With positions = slots (runtime/prompt/positions.py "slots") that is the length."""
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
        for s in self._states:
            s.rewind(0)

    def rewind(self, n: int) -> None:
        """Keep slots 0..n-1 and write the next step's rows from slot n on: a prefix reuse (each state keeps what
        slots 0..n-1 need: rewind). Slots >= n are then stale, masked like those beyond length always are, and
        overwritten by the next writes."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot keep {n} rows of a cache holding {self.length}")
        self._written = max(self._written, self.length)
        self.length = n
        for s in self._states:
            s.rewind(n)

    def checkpoint(self) -> None:
        """A snapshot at the current length in each state that keeps snapshots (none: nothing)."""
        for s in self._snapshotting:
            s.checkpoint(self.length)

    def keeps(self, n: int, ar: int) -> bool:
        """Whether a step of ar rows at the next slot can keep its first n alone (store): always where every state
        is per slot; a recurrent state only n == ar; a windowed cache where its rows after n are those after ar
        (runtime/decode/windowed_state.py)."""
        return n == ar or self._states_keep(n, ar)

    def _states_keep(self, n: int, ar: int) -> bool:
        """Each snapshotting state's own answer to keeps (store's guard asks them, not keeps)."""
        return all(s.keeps(self.length, n, ar) for s in self._snapshotting)

    def restorable(self, n: int, step: int = 1) -> int:
        """The largest slot <= n (a multiple of step; n is one) at which every state can be had again: n where every
        state keeps its prefix by slot, else where the snapshotting states have one (0: the empty state)."""
        for s in self._snapshotting:
            n = min(n, s.restorable(n, step))
        return n

    def costs(self) -> dict[str, float]:
        """The snapshotting states' costs summed: snapshots taken, their time, restores (empty where none)."""
        out: dict[str, float] = {}
        for s in self._snapshotting:
            for k, v in s.costs.items():
                out[k] = out.get(k, 0) + v
        return out

    # --- the cache at the graph edge (runtime/decode/step.py) ---
    def inputs(self) -> list[tuple[str, np.ndarray, bool]]:
        """(graph input name, whole buffer, read as a prefix [:ctx]) of every layer's state, in kv.layers order."""
        return list(self._inputs)

    def output_names(self) -> list[str]:
        return self.spec.state_outputs()

    def feeds(self, ctx: int | None = None) -> dict[str, np.ndarray]:
        """The state as graph inputs; ctx < max_context gives ROWS buffers' prefix [:ctx] (a contiguous view, no
        copy); HEADS buffers and conv windows whole."""
        return {name: buf[:ctx] if prefix else buf for name, buf, prefix in self._inputs}

    def staging(self, ar: int) -> list[np.ndarray]:
        """Where a step's state outputs land before store: each state's staging in turn (attention ROWS: per block
        [layers, 2, ar, dim]; HEADS: none; conv: per layer [ar, channels], or its window's layout), one flat list
        (a batch's call takes row r of each for sequence r)."""
        return [buf for s in self._states for buf in s.staging(ar)]

    def _split(self, staged: list[np.ndarray]):
        """(state, its part of staging()'s list)."""
        for s, lo, hi in self._parts:
            yield s, staged[lo:hi]

    def bind(self, bind, bind_output, ctx: int, staged: list[np.ndarray]) -> None:
        """Every state's buffers as a bound step's inputs / outputs (the layout's way), its outputs into staged."""
        for s, part in self._split(staged):
            s.bind(bind, bind_output, ctx, part)

    def take(self, staged: list[np.ndarray], outputs: dict[str, np.ndarray], slot: int, ar: int) -> None:
        """A plain step's state outputs (by name) into the staging (HEADS attention: into the buffers)."""
        for s, part in self._split(staged):
            s.take(part, outputs, slot, ar)

    def loaders(self) -> list:
        """What a step calls with its first slot before each call: each state's copies of rows into an input."""
        return [f for s in self._loading for f in s.loaders()]

    def load_windows(self, slot: int) -> None:
        """The states' inputs the host copies (the conv layers' windows) for a step whose first row goes to slot."""
        for s in self._loading:
            s.load(slot)

    def load_idle(self) -> None:
        """Those inputs for a batch's row that waits for nothing: zeros."""
        for s in self._loading:
            s.load_idle()

    def store(self, staged: list[np.ndarray], n_valid: int, positions: np.ndarray) -> None:
        """After a step: the first n_valid rows of its staging (staging()) into each state at slots
        length..length+n_valid-1 (padding rows, a lookahead step's rejected drafts: dropped; what a HEADS graph wrote
        beyond them is stale like any slot beyond the length), their positions [rows, ar] kept, the length moved."""
        pos = self.length
        if pos + n_valid > self.max_context:
            raise OverflowError(f"KV cache full: {pos} + {n_valid} > {self.max_context}")
        if n_valid != positions.shape[1] and not self._states_keep(n_valid, positions.shape[1]):  # (a padded static
            # block: its padding would be in; a lookahead call whose caller did not ask keeps)
            raise ValueError(f"a step of {positions.shape[1]} rows cannot be kept in part ({n_valid}) by a state "
                             "not per slot (a static graph without decoder.kind.valid_rows_input: re-export the "
                             "bundle; a lookahead call: CacheRow.verify runs the kept rows again)")
        if n_valid == 1 and self._one_row:  # a decode step's position: one item (no slices)
            self._positions[0, pos] = positions[0, 0]
        else:
            self.positions[:, pos : pos + n_valid] = positions[:, :n_valid]
        for store, part in self._storing:
            store(staged if part is None else staged[part], pos, n_valid)
        self.length = pos + n_valid

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
        for s in self._states:
            s.clear_unused(enc, n, end)
        self._written = n

    def requantize(self, src: dict, dst: dict) -> None:
        """Re-express the uint8 rows 0..length from encoding src into dst (per layer (scale, zp) of K and V, of conv
        rows): q_dst = clip(round((q_src - zp_src) * s_src / s_dst) + zp_dst, 0, 255); the unused slots become dst's
        zero (clear_unused)."""
        for s in self._states:
            s.requantize(src, dst, self.length)
        self.clear_unused(dst)
