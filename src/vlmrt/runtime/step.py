"""One decoder graph call: AR embeddings and their rope positions at the cache's next slots in, logits out.

    step = make_step(session, kind, cache, ctx, ar, io_dtype, shared, rows_out)
    logits = step(embeds, positions, slot)  # embeds [n <= ar, hidden], positions [rows, n] int64 (None: the
                                            # positions buffer already holds them) -> logits [rows_out, vocab]
    kind.store(cache, step.staged, n, step.buffers.positions)   # the one cache update (decoder_kinds.py)

What every decoder kind shares lives here: the step's host buffers (embeddings, positions, logits, ...;
`StepBuffers.load`) and how the graph is called; what differs by kind (a mask or the step's end slot, how the cache
is bound and written) is the kind's (runtime/decoder_kinds.py):
  BoundStep  ORT I/O binding: inputs and outputs are OrtValues over host buffers that live as long as the step
             (embeddings / positions / logits shared by the steps of one AR, `StepBuffers`), so a step allocates
             nothing and never copies the cache at the graph edge.
  PlainStep  session.run(feeds): sessions without io_binding (the torch reference, recorders, fakes in tests),
             and a symbolic-AR graph's short last prompt block (one bound step per block length would pile up).
With a head graph (decoder.kind.hidden_output: the HTP's lm head as its own graph) the decoder graph returns the
final-norm hidden rows and the step runs the head on the last valid one: logits [1, vocab]. With
kind.token_rows_input the graph also takes an int8 row and its scale per token (`StepBuffers.token_row`): a
decode step's row is read from the table straight into the input.
"""

from __future__ import annotations

import time

import numpy as np

from ..format.manifest import DecoderSpec
from .kv_cache import KVCache

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
    (the last rows', asked for by logit_rows [rows_out] where the graph takes it). Those of a bound step do not
    depend on its cache length and are shared by the bound steps of one AR."""

    def __init__(self, dec: DecoderSpec, kind, ar: int, embeds_dtype, logits_dtype, rows_out: int):
        self.embeds = np.zeros((ar, dec.hidden_size), embeds_dtype)
        self.positions = np.zeros((dec.positions.rows, ar), np.int64)
        self.logits = np.zeros((rows_out, dec.vocab_size), logits_dtype)
        self.logit_rows = np.arange(ar - rows_out, ar, dtype=np.int64)
        self.argmax = np.zeros(rows_out, np.int64)  # each logits row's argmax, where the graph returns it
        # memoryviews of the buffers a decode step reads or writes one scalar of: a memoryview item is a plain C
        # load/store, where a numpy scalar index runs its dtype machinery on caches a graph call left cold
        self.argmax_ids = memoryview(self.argmax)  # [rows_out] Python ints
        self._position = memoryview(self.positions.reshape(-1)) if dec.positions.rows == 1 else None
        # a head graph's: the decoder's final-norm rows [ar, hidden], the head's input row [1, hidden]
        self.hidden = np.zeros((ar, dec.hidden_size), np.float32) if kind.hidden_output else None
        self.head_in = np.zeros((1, dec.hidden_size), np.float32) if kind.hidden_output else None
        self.n = 0  # the last load's valid rows
        # views made once for the decode loop (each numpy call after a graph call runs on cold caches)
        self.first, self.first_row = self.embeds[:1], self.embeds[0]
        # kind.token_rows_input: int8 rows [ar, hidden] and their scales [ar] the graph adds to embeds; the
        # scales are 0 but the first one while a decode step's row is there (then embeds[0] is 0: token_mode)
        self.token_rows = self.token_scales = self.token_buf = None
        self.token_mode = False
        if kind.token_rows_input:
            self.token_rows, self.token_scales = np.zeros((ar, dec.hidden_size), np.int8), np.zeros(ar, np.float32)
            self.token_buf = memoryview(self.token_rows[0])  # where a decode step's row is read to (pread)
            self._token_scale = memoryview(self.token_scales)
        self.ar = ar
        # decoder.row_input: a per-token row [ar, width] besides the embeddings (image rows' vision features), zero
        # for text and decode steps; row_dirty: it holds a non-zero row since the last load
        self.row_input = np.zeros((ar, dec.row_input.width), embeds_dtype) if dec.row_input else None
        self.row_dirty = False

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

    def load(self, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None) -> None:
        """The step's inputs in place: embeds [n <= ar, hidden] (zero rows after them) and positions [rows, n]
        (padding rows continue from the last one); embeds may be `first`, the buffer's first row, already written
        (then ar is 1: a decode step, its position set by set_position, positions None). rows [n, width]: the
        decoder's row input (decoder.row_input; None: zeros)."""
        if self.row_dirty:
            self.row_input[...] = 0
            self.row_dirty = False
        if rows is not None:
            self.row_input[: len(rows)] = rows
            self.row_dirty = True
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


class BoundStep:
    def __init__(self, session, kind, cache: KVCache, ctx: int, ar: int, buffers: StepBuffers, head=None,
                 inputs=None):
        """inputs: the kind's step inputs (default kind.step_inputs(ar, ctx, ..); a batch's: decoder_kinds.EndSlots)."""
        import onnxruntime as ort

        dec = kind.dec
        self.session, self.kind, self.ctx, self.buffers, self.cache = session, kind, ctx, buffers, cache
        self.windows = bool(cache.convs)  # conv layers: their windows are loaded before each call
        self.staged = kind.staging(cache, ar)
        self.run_s = 0.0  # the last call's time inside session.run
        self.io = io = session.io_binding()
        ins = {i.name: i for i in session.get_inputs()}
        mask_type = ins.get(getattr(kind.spec, "mask_input", None) or "")
        self.inputs = inputs or kind.step_inputs(ar, ctx, _ORT_DTYPES[mask_type.type] if mask_type else np.float32)
        self._keep = []  # OrtValues (and through them the arrays) bound to io

        def bind(name, arr, output=False):
            v = arr if isinstance(arr, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            (io.bind_ortvalue_output if output else io.bind_ortvalue_input)(name, v)
            return v

        bind(dec.embeds_input, buffers.embeds)
        bind(dec.positions.input, buffers.positions)
        if dec.row_input:
            bind(dec.row_input.input, buffers.row_input)
        self.inputs.bind(bind)
        if kind.token_rows_input:
            bind(kind.token_rows_input, buffers.token_rows)
            bind(kind.token_scales_input, buffers.token_scales)
        if kind.logit_rows_input:
            bind(kind.logit_rows_input, buffers.logit_rows)
        self.head_io = None
        if head is not None:  # decoder -> hidden rows; head: its input row -> logits
            bind(kind.hidden_output, buffers.hidden, output=True)
            self.head_io = head.io_binding()
            self.head = head
            for name, arr, out in ((kind.hidden_output, buffers.head_in, False), (dec.logits_output, buffers.logits, True)):
                v = ort.OrtValue.ortvalue_from_numpy(arr)
                self._keep.append(v)
                (self.head_io.bind_ortvalue_output if out else self.head_io.bind_ortvalue_input)(name, v)
        else:
            bind(dec.logits_output, buffers.logits, output=True)
        if kind.argmax_output:
            bind(kind.argmax_output, buffers.argmax, output=True)
        kind.bind_cache(bind, lambda name, arr: bind(name, arr, output=True), cache, ctx, self.staged)

    def __call__(self, embeds: np.ndarray, positions: np.ndarray | None, slot: int,
                 rows: np.ndarray | None = None) -> np.ndarray:
        """embeds [n <= ar, hidden] at positions [rows, n] (and the row input's rows, None: zeros), going to slots
        slot.. -> logits (a view of the buffer the next step reuses)."""
        self.buffers.load(embeds, positions, rows)
        self.inputs.set(slot)
        if self.windows:
            self.cache.load_windows(slot)
        t = time.perf_counter()
        self.session.run_with_iobinding(self.io)
        if self.head_io is not None:  # the lm head on the last valid row
            b = self.buffers
            b.head_in[0] = b.hidden[b.n - 1]
            self.head.run_with_iobinding(self.head_io)
        self.run_s = time.perf_counter() - t
        return self.buffers.logits


class PlainStep:
    def __init__(self, session, kind, cache: KVCache, ctx: int, ar: int, io_dtype, rows_out: int, head=None):
        self.session, self.kind, self.cache, self.ctx, self.ar, self.head = session, kind, cache, ctx, ar, head
        self.buffers = StepBuffers(kind.dec, kind, ar, io_dtype, io_dtype, rows_out)
        self.staged = kind.staging(cache, ar)
        self.run_s = 0.0
        self.inputs = kind.step_inputs(ar, ctx, io_dtype)
        dec = kind.dec
        self._out_names = [kind.hidden_output if head is not None else dec.logits_output, *cache.output_names(),
                           *([kind.argmax_output] if kind.argmax_output else [])]

    def __call__(self, embeds: np.ndarray, positions: np.ndarray | None, slot: int,
                 rows: np.ndarray | None = None) -> np.ndarray:
        b, k, c = self.buffers, self.kind, self.cache
        d = k.dec
        b.load(embeds, positions, rows)
        self.inputs.set(slot)
        c.load_windows(slot)
        feeds = {d.embeds_input: b.embeds, d.positions.input: b.positions, **self.inputs.feeds()}
        if d.row_input:
            feeds[d.row_input.input] = b.row_input
        feeds.update(c.feeds(self.ctx))
        if k.logit_rows_input:
            feeds[k.logit_rows_input] = b.logit_rows
        if k.token_rows_input:
            feeds[k.token_rows_input], feeds[k.token_scales_input] = b.token_rows, b.token_scales
        t = time.perf_counter()
        logits, *rows = self.session.run(self._out_names, feeds)
        if self.head is not None:  # logits is the hidden rows: the lm head on the last valid one
            logits = self.head.run([d.logits_output], {k.hidden_output: np.asarray(logits[b.n - 1 : b.n], np.float32)})[0]
        self.run_s = time.perf_counter() - t
        if k.argmax_output:
            b.argmax[:] = rows.pop()
        k.take(c, self.staged, rows, slot, self.ar)
        return logits


def make_step(session, kind, cache: KVCache, ctx: int, ar: int, io_dtype,
              shared: dict[tuple, StepBuffers] | None = None, rows_out: int | None = None, head=None):
    """A BoundStep when the session can bind (its buffers taken from / added to `shared`), else a PlainStep.
    kind: the decoder kind (decoder_kinds.py). rows_out: logits rows (kind.logits_rows()), by default the kind's.
    head: the head graph's session (kind.hidden_output)."""
    rows_out = kind.logits_rows(ar) if rows_out is None else rows_out
    if not can_bind(session) or (head is not None and not can_bind(head)):
        return PlainStep(session, kind, cache, ctx, ar, io_dtype, rows_out, head)
    key = buffers_key(session, kind.dec, ar, rows_out, head)
    shared = {} if shared is None else shared
    if key not in shared:
        _, _, embeds, logits = key
        shared[key] = StepBuffers(kind.dec, kind, ar, _ORT_DTYPES[embeds], _ORT_DTYPES[logits], rows_out)
    return BoundStep(session, kind, cache, ctx, ar, shared[key], head)
