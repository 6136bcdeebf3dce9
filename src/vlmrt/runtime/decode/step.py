"""One decoder graph call: AR embeddings and their rope positions at the cache's next slots in, logits out.

    step = make_step(session, kind, cache, ctx, ar, io_dtype, shared, rows_out)
    logits = step(embeds, positions, slot)  # embeds [n <= ar, hidden], positions [rows, n] int64 (None: the
                                            # positions buffer already holds them) -> logits [rows_out, vocab]
    kind.store(cache, step.staged, n, step.buffers.positions)   # the one cache update (KVCache.store)

A step is a list of parts (runtime/decode/step_features.py): the decoder kind's (embeddings and positions, the logits or a
head graph, and the optional features the manifest names: token rows, logit rows, argmax, row input), the cache
(CachePart: its state kinds, runtime/decode/state_kinds.py) and the kind's step inputs (a mask or the end slot). Both ways
of calling the graph loop over the same parts:
  BoundStep  ORT I/O binding: each part binds its inputs and outputs once, as OrtValues over host buffers that live as
             long as the step (embeddings / positions / logits shared by the steps of one AR, `StepBuffers`), so a
             step allocates nothing and never copies the cache at the graph edge; a call runs the parts' before-hooks
             (the mask's or end slot's set, the conv windows' load), the graph, the after-hooks (a head graph).
  PlainStep  session.run(feeds): each part feeds its inputs and takes its outputs; sessions without io_binding (the
             torch reference, recorders, fakes in tests), and a symbolic-AR graph's short last prompt block (one
             bound step per block length would pile up).
"""

from __future__ import annotations

import time

import numpy as np

from ...format.manifest import DecoderSpec
from .kv_cache import KVCache
from .step_features import Part, step_parts

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def can_bind(session) -> bool:
    """onnxruntime sessions can; the reference's torch modules and test fakes cannot."""
    return hasattr(session, "io_binding")


def buffers_key(session, dec: DecoderSpec, ar: int, rows_out: int, head=None) -> tuple:
    """Steps with the same AR, logits rows and I/O types can share their StepBuffers (steps never run concurrently)."""
    ins = {i.name: i.type for i in session.get_inputs()}
    outs = {o.name: o.type for o in (head or session).get_outputs()}
    return ar, rows_out, ins[dec.embeds_input], outs[dec.logits_output]


class StepBuffers:
    """The host buffers of a step: embeddings [ar, hidden], positions [rope rows, ar] int64, logits [rows_out, vocab]
    (the last rows'), each logits row's argmax, and what the kind's parts add (step_features: alloc): logit_rows
    [rows_out], token_rows / token_scales, row_input, a head graph's hidden / head_in (None where the decoder has no
    such part). Those of a bound step do not depend on its cache length and are shared by the bound steps of one AR."""

    def __init__(self, dec: DecoderSpec, kind, ar: int, embeds_dtype, logits_dtype, rows_out: int):
        self.ar, self.rows_out = ar, rows_out
        self.embeds = np.zeros((ar, dec.hidden_size), embeds_dtype)
        self.positions = np.zeros((dec.positions.rows, ar), np.int64)
        self.logits = np.zeros((rows_out, dec.vocab_size), logits_dtype)
        self.out = self.logits  # a plain call's logits (the session's array); a bound step's are `logits`
        self.argmax = np.zeros(rows_out, np.int64)  # each logits row's argmax, where the graph returns it
        # memoryviews of the buffers a decode step reads or writes one scalar of: a memoryview item is a plain C
        # load/store, where a numpy scalar index runs its dtype machinery on caches a graph call left cold
        self.argmax_ids = memoryview(self.argmax)  # [rows_out] Python ints
        self._position = memoryview(self.positions.reshape(-1)) if dec.positions.rows == 1 else None
        self.n = 0  # the last load's valid rows
        # views made once for the decode loop (each numpy call after a graph call runs on cold caches)
        self.first, self.first_row = self.embeds[:1], self.embeds[0]
        self.logit_rows = self.hidden = self.head_in = self.token_rows = self.token_scales = self.token_buf = None
        self.token_mode = False  # token_rows[0] holds a decode step's row (token_row)
        self.row_input = self.valid_rows = None
        self.valid_n = 0
        self.row_dirty = False  # row_input holds a non-zero row since the last load
        self.spans = None
        self.span_dirty = False  # spans holds a span (>= 0) since the last load
        for part in (kind.output, *kind.features):
            part.alloc(self)

    def token_row(self, scale: float) -> memoryview:
        """A decode step's input as an int8 row: the buffer to read the token's row into (token_rows[0]), its scale
        (a float32 value) set; embeds[0] is 0 then (then load(first, ...))."""
        if not self.token_mode:
            self.first_row[...] = 0
            self.token_mode = True
        self._token_scale[0] = scale
        return self.token_buf

    def set_position(self, p: int) -> None:
        """A decode step's position (every rope row: a generated token is text)."""
        if self._position is not None:
            self._position[0] = p
        else:
            self.positions[:, 0] = p

    def load(self, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None,
             spans: np.ndarray | None = None) -> None:
        """The step's inputs in place: embeds [n <= ar, hidden] (zero rows after them) and positions [rows, n]
        (padding rows continue from the last one); embeds may be `first`, the buffer's first row, already written
        (then ar is 1: a decode step, its position set by set_position, positions None). rows [n, width]: the
        decoder's row input (decoder.row_input; None: zeros); spans [n]: the rows' image spans (decoder.span_input;
        None: -1, no span)."""
        if self.row_dirty:
            self.row_input[...] = 0
            self.row_dirty = False
        if rows is not None:
            self.row_input[: len(rows)] = rows
            self.row_dirty = True
        if self.span_dirty:
            self.spans[...] = -1
            self.span_dirty = False
        if spans is not None and self.spans is not None:
            self.spans[: len(spans)] = spans
            self.span_dirty = True
        if embeds is self.first:  # CacheRow.step_token wrote the row in place (or the token's int8 row: token_mode)
            self.n = 1
            return
        if self.token_mode:
            self.token_scales[0] = 0
            self.token_mode = False
        n = self.n = embeds.shape[0]
        ar = self.ar
        self.embeds[:n] = embeds
        self.positions[:, :n] = positions
        if n < ar:
            self.embeds[n:] = 0  # a static graph's padded last block: computed, never written to the cache
            self.positions[:, n:] = positions[:, -1:] + np.arange(1, ar - n + 1)


class CachePart(Part):
    """The cache as a step's part: its states' inputs (ROWS: the prefix [:ctx]) and outputs, into `staged` (a step's
    new rows until KVCache.store)."""

    def __init__(self, cache: KVCache, ctx: int, ar: int):
        self.cache, self.ctx, self.ar = cache, ctx, ar
        self.staged = cache.staging(ar)
        self.outputs = tuple(cache.output_names())

    def bind(self, io, b) -> None:
        self.cache.bind(io.input, io.output, self.ctx, self.staged)
        for load in self.cache.loaders():
            io.before(load)

    def feed(self, feeds: dict, step, slot: int) -> None:
        self.cache.load_windows(slot)
        feeds.update(self.cache.feeds(self.ctx))

    def take(self, step, values: list[np.ndarray], slot: int) -> None:
        self.cache.take(self.staged, dict(zip(self.outputs, values)), slot, self.ar)


class Binding:
    """A bound step's I/O binding: host arrays bound as OrtValues kept alive with the step, and what the parts do
    before (f(slot)) and after (f()) each call."""

    def __init__(self, session, head=None):
        import onnxruntime as ort

        self._from_numpy, self._ortvalue = ort.OrtValue.ortvalue_from_numpy, ort.OrtValue
        self.io, self.head = session.io_binding(), head
        self.keep: list = []  # OrtValues (and through them the arrays) bound to io
        self.before_call: list = []
        self.after_call: list = []

    def value(self, arr):
        v = arr if isinstance(arr, self._ortvalue) else self._from_numpy(arr)
        self.keep.append(v)
        return v

    def input(self, name: str, arr):
        v = self.value(arr)
        self.io.bind_ortvalue_input(name, v)
        return v

    def output(self, name: str, arr):
        v = self.value(arr)
        self.io.bind_ortvalue_output(name, v)
        return v

    def before(self, f) -> None:
        self.before_call.append(f)

    def after(self, f) -> None:
        self.after_call.append(f)


def _chain(hooks: list):
    """The parts' after-call hooks as one call (None where there are none: the decode loop's usual case)."""
    if len(hooks) < 2:
        return hooks[0] if hooks else None
    hooks = tuple(hooks)

    def each() -> None:
        for f in hooks:
            f()

    return each


class BoundStep:
    def __init__(self, session, kind, cache: KVCache, ctx: int, ar: int, buffers: StepBuffers, head=None,
                 inputs=None):
        """inputs: the kind's step inputs (default kind.step_inputs(ar, ctx, ..); a batch's: step_features.EndSlots)."""
        self.session, self.kind, self.ctx, self.buffers, self.cache = session, kind, ctx, buffers, cache
        self.run_s = 0.0  # the last call's time inside session.run (and the head graph's)
        ins = {i.name: i.type for i in session.get_inputs()}
        self.inputs = inputs or kind.step_inputs(ar, ctx, lambda name: _ORT_DTYPES[ins[name]] if name in ins else np.float32)
        state = CachePart(cache, ctx, ar)
        self.staged = state.staged
        binding = Binding(session, head)
        for part in step_parts(kind, state, self.inputs):
            part.bind(binding, buffers)
        self.io, self._keep = binding.io, binding.keep
        self._before, self._after = tuple(binding.before_call), _chain(binding.after_call)

    def __call__(self, embeds: np.ndarray, positions: np.ndarray | None, slot: int,
                 rows: np.ndarray | None = None, spans: np.ndarray | None = None) -> np.ndarray:
        """embeds [n <= ar, hidden] at positions [rows, n] (and the row input's rows, None: zeros), going to slots
        slot.. -> logits (a view of the buffer the next step reuses); spans: the rows' image spans (None: none)."""
        self.buffers.load(embeds, positions, rows, spans)
        for f in self._before:
            f(slot)
        t = time.perf_counter()
        self.session.run_with_iobinding(self.io)
        if self._after is not None:
            self._after()
        self.run_s = time.perf_counter() - t
        return self.buffers.logits


class PlainStep:
    def __init__(self, session, kind, cache: KVCache, ctx: int, ar: int, io_dtype, rows_out: int, head=None):
        self.session, self.kind, self.cache, self.ctx, self.ar, self.head = session, kind, cache, ctx, ar, head
        self.buffers = StepBuffers(kind.dec, kind, ar, io_dtype, io_dtype, rows_out)
        self.run_s = 0.0
        self.inputs = kind.step_inputs(ar, ctx, lambda name: io_dtype)
        state = CachePart(cache, ctx, ar)
        self.staged = state.staged
        self.parts = step_parts(kind, state, self.inputs)
        self._out_names = [name for p in self.parts for name in p.outputs]
        self._takes = [(p, len(p.outputs)) for p in self.parts if p.outputs]

    def __call__(self, embeds: np.ndarray, positions: np.ndarray | None, slot: int,
                 rows: np.ndarray | None = None, spans: np.ndarray | None = None) -> np.ndarray:
        self.buffers.load(embeds, positions, rows, spans)
        feeds: dict[str, np.ndarray] = {}
        for p in self.parts:
            p.feed(feeds, self, slot)
        t = time.perf_counter()
        values = self.session.run(self._out_names, feeds)
        at = 0
        for p, n in self._takes:  # (a head graph's take runs the head)
            p.take(self, values[at : at + n], slot)
            at += n
        self.run_s = time.perf_counter() - t
        return self.buffers.out


def make_step(session, kind, cache: KVCache, ctx: int, ar: int, io_dtype,
              shared: dict[tuple, StepBuffers] | None = None, rows_out: int | None = None, head=None):
    """A BoundStep when the session can bind (its buffers taken from / added to `shared`), else a PlainStep.
    kind: the decoder kind (decoder_kinds.py). rows_out: logits rows (kind.logits_rows()), by default the kind's.
    head: the head graph's session (decoder.kind.hidden_output)."""
    rows_out = kind.logits_rows(ar) if rows_out is None else rows_out
    if not can_bind(session) or (head is not None and not can_bind(head)):
        return PlainStep(session, kind, cache, ctx, ar, io_dtype, rows_out, head)
    key = buffers_key(session, kind.dec, ar, rows_out, head)
    shared = {} if shared is None else shared
    if key not in shared:
        _, _, embeds, logits = key
        shared[key] = StepBuffers(kind.dec, kind, ar, _ORT_DTYPES[embeds], _ORT_DTYPES[logits], rows_out)
    return BoundStep(session, kind, cache, ctx, ar, shared[key], head)
