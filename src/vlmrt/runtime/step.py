"""One decoder graph call: AR embeddings at the cache's next positions in, logits out, the new K/V rows staged.

    step = make_step(session, dec, cache, ctx, ar, io_dtype, shared, rows_out)
    logits = step(embeds, pos)        # embeds [n <= ar, hidden] -> logits [rows_out, vocab], the last rows'
    cache.write(step.rows, n)         # rows [layers, 2, ar, dim]: KVCache.write is the one cache update

Both kinds of step read the cache prefix [:ctx] where it is and build positions and mask the same way
(`StepBuffers.load`); they differ only in how the graph is called:
  BoundStep  ORT I/O binding: inputs and outputs are OrtValues over host buffers that live as long as the step
             (embeddings / positions / logits / staging rows shared by the steps of one AR, `StepBuffers`), so a
             step allocates nothing and never copies the cache at the graph edge.
  PlainStep  session.run(feeds): sessions without io_binding (the torch reference, recorders, fakes in tests),
             and a symbolic-AR graph's short last prompt block (one bound step per block length would pile up).
With a head graph (DecoderSpec.hidden_output: the HTP's lm head as its own graph) the decoder graph returns the
final-norm hidden rows and the step runs the head on the last valid one: logits [1, vocab].
With the in_place cache layout (kv_cache.py) a step feeds the step's end (seqlens_k, total_sequence_length) instead
of positions and a mask, the graph writes the new rows into the cache itself (a bound step binds each buffer as
input and output) and `rows` is None. With DecoderSpec.token_rows_input the graph also takes an int8 row and its
scale per token (`StepBuffers.token_row`): a decode step's row is read from the table straight into the input.
"""

from __future__ import annotations

import time

import numpy as np

from ..manifest import DecoderSpec
from .kv_cache import KVCache, attention_mask

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def can_bind(session) -> bool:
    """onnxruntime sessions can; the reference's torch modules and test fakes cannot."""
    return hasattr(session, "io_binding")


def buffers_key(session, dec: DecoderSpec, ar: int, rows_out: int, head=None) -> tuple:
    """Steps with the same AR, logits rows and I/O types can share their StepBuffers (steps never run concurrently)."""
    ins = {i.name: i.type for i in session.get_inputs()}
    outs = {o.name: o.type for o in (head or session).get_outputs()}
    positions = ins[dec.positions_input] if dec.positions_input else "tensor(int64)"
    return ar, rows_out, ins[dec.embeds_input], positions, outs[dec.logits_output]


def logits_rows(dec: DecoderSpec, ar: int, all_rows: bool = False) -> int:
    """How many (last) rows' logits a step of AR tokens returns: all_rows (a lookahead verify step) needs
    DecoderSpec.logit_rows_input or a static graph (every row's); else 1 with logit_rows_input or last_logits, ar for
    a static graph."""
    if all_rows:
        if dec.last_logits or dec.hidden_output:  # (a head graph maps one row)
            raise ValueError("this decoder graph cannot return the logits of every row")
        return ar
    return 1 if dec.logit_rows_input or dec.last_logits or dec.hidden_output else ar


class StepBuffers:
    """The host buffers of a step: embeddings [ar, hidden], positions [ar], logits [rows_out, vocab] (the last rows',
    asked for by logit_rows [rows_out] where the graph takes it) and the staging block [layers, 2, ar, dim] for the
    new K/V rows. Those of a bound step do not depend on its cache length and are
    shared by the bound steps of one AR (an AR=32 staging block is 1.5 MB for SmolLM2)."""

    def __init__(self, dec: DecoderSpec, cache: KVCache, ar: int, embeds_dtype, positions_dtype, logits_dtype,
                 rows_out: int):
        self.embeds = np.zeros((ar, dec.hidden_size), embeds_dtype)
        self.positions = np.zeros(ar, positions_dtype)
        self.logits = np.zeros((rows_out, dec.vocab_size), logits_dtype)
        self.logit_rows = np.arange(ar - rows_out, ar, dtype=np.int64)
        self.in_place = cache.in_place
        self.rows = None if cache.in_place else np.zeros((cache.spec.layers, 2, ar, cache.spec.dim), cache.dtype)
        self.seqlens, self.total = np.zeros(1, np.int32), np.zeros((), np.int32)  # in_place: the step's end
        self.argmax = np.zeros(rows_out, np.int64)  # each logits row's argmax, where the graph returns it
        # memoryviews of the buffers a decode step reads or writes one scalar of: a memoryview item is a plain C
        # load/store, where a numpy scalar index runs its dtype machinery on caches a graph call left cold
        self.argmax_ids = memoryview(self.argmax)  # [rows_out] Python ints
        self._seqlens, self._total = memoryview(self.seqlens), memoryview(self.total.reshape(1))
        # a head graph's: the decoder's final-norm rows [ar, hidden], the head's input row [1, hidden]
        self.hidden = np.zeros((ar, dec.hidden_size), np.float32) if dec.hidden_output else None
        self.head_in = np.zeros((1, dec.hidden_size), np.float32) if dec.hidden_output else None
        self.n = 0  # the last load's valid rows
        # views made once for the decode loop (each numpy call after a graph call runs on cold caches)
        self.first, self.first_row = self.embeds[:1], self.embeds[0]
        # DecoderSpec.token_rows_input: int8 rows [ar, hidden] and their scales [ar] the graph adds to embeds; the
        # scales are 0 but the first one while a decode step's row is there (then embeds[0] is 0: token_mode)
        self.token_rows = self.token_scales = self.token_buf = None
        self.token_mode = False
        if dec.token_rows_input:
            self.token_rows, self.token_scales = np.zeros((ar, dec.hidden_size), np.int8), np.zeros(ar, np.float32)
            self.token_buf = memoryview(self.token_rows[0])  # where a decode step's row is read to (pread)
            self._token_scale = memoryview(self.token_scales)
        self.ar, self._range = ar, np.arange(ar, dtype=positions_dtype)

    def token_row(self, scale: float) -> memoryview:
        """A decode step's input as an int8 row: the buffer to read the token's row into (token_rows[0]), its scale
        (a float32 value) set; embeds[0] is 0 then (then load(first, pos))."""
        if not self.token_mode:
            self.first_row[...] = 0
            self.token_mode = True
        self._token_scale[0] = scale
        return self.token_buf

    def load(self, embeds: np.ndarray, pos: int) -> None:
        """The step's inputs in place: embeds [n <= ar, hidden] (zero rows after them), positions pos..; embeds
        may be `first`, the buffer's first row, already written (then ar is 1: a decode step)."""
        ar = self.ar
        if self.in_place:  # (positions are not an input then)
            self._seqlens[0] = pos + ar - 1
            self._total[0] = pos + ar
        if embeds is self.first:  # Engine.step_token wrote the row in place (or the token's int8 row: token_mode)
            if not self.in_place:
                self.positions[0] = pos
            self.n = 1
            return
        if self.token_mode:
            self.token_scales[0] = 0
            self.token_mode = False
        n = self.n = embeds.shape[0]
        self.embeds[:n] = embeds
        if n < ar:
            self.embeds[n:] = 0  # a static graph's padded last block: computed, never written to the cache
        np.add(self._range, pos, out=self.positions)


class StepMask:
    """A step's additive mask [ar, ctx + ar] (kv_cache.attention_mask), kept across calls: a step at a later
    position than the last only unmasks the slots in between (one slot per decode step), else it is rebuilt."""

    def __init__(self, ar: int, ctx: int, dtype, neg: float | None):
        self.array = np.zeros((ar, ctx + ar), dtype)
        self.ar, self.ctx, self.neg = ar, ctx, neg
        self.pos = -1  # the position the array is for; -1: none yet

    def at(self, pos: int) -> np.ndarray:
        if 0 <= self.pos <= pos:
            self.array[:, self.pos : pos] = 0  # the cache now also holds positions self.pos..pos-1
        else:
            attention_mask(pos, self.ar, self.ctx, self.array.dtype, out=self.array, neg=self.neg)
        self.pos = pos
        return self.array


class BoundStep:
    def __init__(self, session, dec: DecoderSpec, cache: KVCache, ctx: int, ar: int, buffers: StepBuffers, head=None):
        import onnxruntime as ort

        self.session, self.ctx, self.buffers = session, ctx, buffers
        self.rows = buffers.rows
        self.run_s = 0.0  # the last call's time inside session.run
        self.io = io = session.io_binding()
        ins = {i.name: i for i in session.get_inputs()}
        self.mask = None if cache.in_place else StepMask(ar, ctx, _ORT_DTYPES[ins[dec.mask_input].type], dec.mask_value)
        self._keep = []  # OrtValues (and through them the arrays) bound to io

        def bind(name, arr, output=False):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            (io.bind_ortvalue_output if output else io.bind_ortvalue_input)(name, v)
            return v

        bind(dec.embeds_input, buffers.embeds)
        if dec.token_rows_input:
            bind(dec.token_rows_input, buffers.token_rows)
            bind(dec.token_scales_input, buffers.token_scales)
        if dec.logit_rows_input:
            bind(dec.logit_rows_input, buffers.logit_rows)
        self.head_io = None
        if head is not None:  # decoder -> hidden rows; head: its input row -> logits
            bind(dec.hidden_output, buffers.hidden, output=True)
            self.head_io = head.io_binding()
            self.head = head
            for name, arr, out in ((dec.hidden_output, buffers.head_in, False), (dec.logits_output, buffers.logits, True)):
                v = ort.OrtValue.ortvalue_from_numpy(arr)
                self._keep.append(v)
                (self.head_io.bind_ortvalue_output if out else self.head_io.bind_ortvalue_input)(name, v)
        else:
            bind(dec.logits_output, buffers.logits, output=True)
        if dec.argmax_output:
            bind(dec.argmax_output, buffers.argmax, output=True)
        s = cache.spec
        if cache.in_place:
            bind(dec.seqlens_input, buffers.seqlens)
            bind(dec.total_length_input, buffers.total)
            for i in range(s.layers):  # one OrtValue per buffer, as input and output: the graph updates it in place
                for kv, (name_in, name_out) in enumerate(((s.key_input, s.key_output), (s.value_input, s.value_output))):
                    v = bind(name_in.format(layer=i), cache.data[i, kv])
                    io.bind_ortvalue_output(name_out.format(layer=i), v)
            return
        bind(dec.positions_input, buffers.positions)
        bind(dec.mask_input, self.mask.array)
        for i in range(s.layers):
            bind(s.key_input.format(layer=i), cache.data[i, 0, :ctx])  # contiguous prefix: no copy
            bind(s.value_input.format(layer=i), cache.data[i, 1, :ctx])
            bind(s.key_output.format(layer=i), self.rows[i, 0], output=True)
            bind(s.value_output.format(layer=i), self.rows[i, 1], output=True)

    def __call__(self, embeds: np.ndarray, pos: int) -> np.ndarray:
        """embeds [n <= ar, hidden] at positions pos.. -> logits (a view of the buffer the next step reuses)."""
        self.buffers.load(embeds, pos)
        if self.mask is not None:
            self.mask.at(pos)
        t = time.perf_counter()
        self.session.run_with_iobinding(self.io)
        if self.head_io is not None:  # the lm head on the last valid row
            b = self.buffers
            b.head_in[0] = b.hidden[b.n - 1]
            self.head.run_with_iobinding(self.head_io)
        self.run_s = time.perf_counter() - t
        return self.buffers.logits


class PlainStep:
    def __init__(self, session, dec: DecoderSpec, cache: KVCache, ctx: int, ar: int, io_dtype, rows_out: int,
                 head=None):
        self.session, self.dec, self.cache, self.ctx, self.ar, self.head = session, dec, cache, ctx, ar, head
        self.buffers = StepBuffers(dec, cache, ar, io_dtype, np.int64, io_dtype, rows_out)
        self.rows = self.buffers.rows
        self.run_s = 0.0
        self.mask = StepMask(ar, ctx, io_dtype, dec.mask_value)
        self._out_names = [dec.hidden_output if head is not None else dec.logits_output, *cache.output_names(),
                           *([dec.argmax_output] if dec.argmax_output else [])]

    def __call__(self, embeds: np.ndarray, pos: int) -> np.ndarray:
        b, d, c = self.buffers, self.dec, self.cache
        b.load(embeds, pos)
        if c.in_place:
            feeds = {d.embeds_input: b.embeds, d.seqlens_input: b.seqlens, d.total_length_input: b.total}
        else:
            feeds = {d.embeds_input: b.embeds, d.positions_input: b.positions, d.mask_input: self.mask.at(pos)}
        feeds.update(c.feeds(self.ctx))
        if d.logit_rows_input:
            feeds[d.logit_rows_input] = b.logit_rows
        if d.token_rows_input:
            feeds[d.token_rows_input], feeds[d.token_scales_input] = b.token_rows, b.token_scales
        t = time.perf_counter()
        logits, *rows = self.session.run(self._out_names, feeds)
        if self.head is not None:  # logits is the hidden rows: the lm head on the last valid one
            logits = self.head.run([d.logits_output], {d.hidden_output: np.asarray(logits[b.n - 1 : b.n], np.float32)})[0]
        self.run_s = time.perf_counter() - t
        if d.argmax_output:
            b.argmax[:] = rows.pop()
        for j, r in enumerate(rows):  # output_names() order: K, V of layer 0, 1, ...
            if c.in_place:  # the whole updated buffer: take the step's slots
                c.data[j // 2, j % 2][..., pos : pos + self.ar, :] = r[..., pos : pos + self.ar, :]
            else:
                self.rows[j // 2, j % 2] = r
        return logits


def make_step(session, dec: DecoderSpec, cache: KVCache, ctx: int, ar: int, io_dtype,
              shared: dict[tuple, StepBuffers] | None = None, rows_out: int | None = None, head=None):
    """A BoundStep when the session can bind (its buffers taken from / added to `shared`), else a PlainStep.
    rows_out: logits rows (logits_rows()), by default the decoder's for a plain step. head: the head graph's
    session (DecoderSpec.hidden_output)."""
    rows_out = logits_rows(dec, ar) if rows_out is None else rows_out
    if not can_bind(session) or (head is not None and not can_bind(head)):
        return PlainStep(session, dec, cache, ctx, ar, io_dtype, rows_out, head)
    key = buffers_key(session, dec, ar, rows_out, head)
    shared = {} if shared is None else shared
    if key not in shared:
        _, _, embeds, positions, logits = key
        shared[key] = StepBuffers(dec, cache, ar, _ORT_DTYPES[embeds], _ORT_DTYPES[positions], _ORT_DTYPES[logits],
                                  rows_out)
    return BoundStep(session, dec, cache, ctx, ar, shared[key], head)
