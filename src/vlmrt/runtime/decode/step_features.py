"""A decoder step's parts, each binding (a bound step) or feeding and taking (a plain step) its own tensors: a step
loops over its parts instead of asking which the decoder has (runtime/decode/step.py).

    output, features = decoder_features(dec)          # built from the manifest in one place (decoder.kind.parts())
    parts = step_parts(kind, cache_part, step_inputs)  # [output, the cache, *features, the kind's step inputs]

  Embeds       inputs_embeds [ar, hidden] and the rope positions [rows, ar]: every kind's
  Logits       the logits output [rows_out, vocab]; or
  HeadGraph    decoder.kind.hidden_output: the decoder returns its final-norm rows [ar, hidden] and the head graph
               (graphs.head, the HTP's lm head) maps the last valid one to logits [1, vocab] after each call
  TokenRows    token_rows_input / token_scales_input: an int8 row [ar, hidden] and its scale [ar] per token the graph
               adds to the embeddings (a decode step reads its row straight into the input: StepBuffers.token_row)
  LogitRows    logit_rows_input [rows_out] int64: which (last) rows' logits the graph returns
  Argmax       argmax_output [rows_out] int64: each logits row's argmax (greedy decoding reads it)
  RowInput     decoder.row_input [ar, width]: a per-token row beside the embeddings (image rows' vision features)
  SpanInput    decoder.span_input [ar] int64: each row's image span, -1 for none (decode and verify steps: all -1)
  ValidRows    valid_rows_input [ar] float32: 1 for the step's rows, 0 for a static graph's padding (a recurrent
               layer's graph keeps its state at the last real row)
  StepMask     a rows kind's additive mask [ar, ctx + ar] (from slots), set before each call
  EndSlot(s)   gqa_in_place's end slot: seqlens_k, total_sequence_length (a batch's: one per sequence)
The cache is a part too (step.CachePart over runtime/decode/kv_cache.py's states).

Each part has:
  alloc(b)                  its host buffers in the step's StepBuffers (shared by the bound steps of one AR)
  bind(io, b)               a bound step's: its inputs / outputs on io (step.Binding); io.before(f) / io.after(f): what
                            it does before (f(slot)) / after (f()) each call
  feed(feeds, step, slot)   a plain step's inputs into feeds
  outputs                   the outputs a plain step takes for it, in order (take(step, values, slot) gets them)
"""

from __future__ import annotations

import numpy as np

from ...format.manifest import DecoderSpec, KindParts
from .kv_cache import attention_mask


class Part:
    """What a part does not need: no buffers, no inputs, no outputs."""

    outputs: tuple[str, ...] = ()

    def alloc(self, b) -> None:
        pass

    def feed(self, feeds: dict, step, slot: int) -> None:
        pass

    def take(self, step, values: list[np.ndarray], slot: int) -> None:
        pass


class Embeds(Part):
    def __init__(self, dec: DecoderSpec):
        self.embeds, self.positions = dec.embeds_input, dec.positions.input

    def bind(self, io, b) -> None:
        io.input(self.embeds, b.embeds)
        io.input(self.positions, b.positions)

    def feed(self, feeds: dict, step, slot: int) -> None:
        feeds[self.embeds], feeds[self.positions] = step.buffers.embeds, step.buffers.positions


class Logits(Part):
    def __init__(self, name: str):
        self.outputs = (name,)

    def bind(self, io, b) -> None:
        io.output(self.outputs[0], b.logits)

    def take(self, step, values: list[np.ndarray], slot: int) -> None:
        step.buffers.out = values[0]


class HeadGraph(Part):
    """The decoder's final-norm rows out; the head graph (the step's `head` session) on the last valid one."""

    def __init__(self, hidden: str, logits: str):
        self.hidden, self.logits = hidden, logits
        self.outputs = (hidden,)

    def alloc(self, b) -> None:
        b.hidden = np.zeros((b.ar, b.embeds.shape[1]), np.float32)  # [ar, hidden]
        b.head_in = np.zeros((1, b.embeds.shape[1]), np.float32)  # the head's input row

    def bind(self, io, b) -> None:
        io.output(self.hidden, b.hidden)
        head = io.head
        hio = head.io_binding()
        hio.bind_ortvalue_input(self.hidden, io.value(b.head_in))
        hio.bind_ortvalue_output(self.logits, io.value(b.logits))

        def run() -> None:  # the lm head on the last valid row
            b.head_in[0] = b.hidden[b.n - 1]
            head.run_with_iobinding(hio)

        io.after(run)

    def take(self, step, values: list[np.ndarray], slot: int) -> None:
        n = step.buffers.n
        step.buffers.out = step.head.run([self.logits], {self.hidden: np.asarray(values[0][n - 1 : n], np.float32)})[0]


class TokenRows(Part):
    def __init__(self, rows: str, scales: str):
        self.rows, self.scales = rows, scales

    def alloc(self, b) -> None:
        # int8 rows [ar, hidden] and their scales [ar] the graph adds to embeds; the scales are 0 but the first one
        # while a decode step's row is there (then embeds[0] is 0: StepBuffers.token_mode)
        b.token_rows, b.token_scales = np.zeros((b.ar, b.embeds.shape[1]), np.int8), np.zeros(b.ar, np.float32)
        b.token_buf = memoryview(b.token_rows[0])  # where a decode step's row is read to (pread)
        b._token_scale = memoryview(b.token_scales)

    def bind(self, io, b) -> None:
        io.input(self.rows, b.token_rows)
        io.input(self.scales, b.token_scales)

    def feed(self, feeds: dict, step, slot: int) -> None:
        feeds[self.rows], feeds[self.scales] = step.buffers.token_rows, step.buffers.token_scales


class LogitRows(Part):
    def __init__(self, name: str):
        self.name = name

    def alloc(self, b) -> None:
        b.logit_rows = np.arange(b.ar - b.rows_out, b.ar, dtype=np.int64)

    def bind(self, io, b) -> None:
        io.input(self.name, b.logit_rows)

    def feed(self, feeds: dict, step, slot: int) -> None:
        feeds[self.name] = step.buffers.logit_rows


class Argmax(Part):
    def __init__(self, name: str):
        self.outputs = (name,)

    def bind(self, io, b) -> None:
        io.output(self.outputs[0], b.argmax)

    def take(self, step, values: list[np.ndarray], slot: int) -> None:
        step.buffers.argmax[:] = values[0]


class RowInput(Part):
    def __init__(self, name: str, width: int):
        self.name, self.width = name, width

    def alloc(self, b) -> None:
        # zero for text and decode steps (StepBuffers.load: row_dirty)
        b.row_input = np.zeros((b.ar, self.width), b.embeds.dtype)

    def bind(self, io, b) -> None:
        io.input(self.name, b.row_input)

    def feed(self, feeds: dict, step, slot: int) -> None:
        feeds[self.name] = step.buffers.row_input


class SpanInput(Part):
    def __init__(self, name: str):
        self.name = name

    def alloc(self, b) -> None:
        b.spans = np.full(b.ar, -1, np.int64)  # -1 but on a prompt block's span rows (StepBuffers.load: span_dirty)

    def bind(self, io, b) -> None:
        io.input(self.name, b.spans)

    def feed(self, feeds: dict, step, slot: int) -> None:
        feeds[self.name] = step.buffers.spans


class ValidRows(Part):
    def __init__(self, name: str):
        self.name = name

    def alloc(self, b) -> None:
        b.valid_rows = np.ones(b.ar, np.float32)
        b.valid_n = b.ar  # the real rows valid_rows says now

    @staticmethod
    def set(b) -> None:
        if b.valid_n != b.n:  # (a decode step's, and every full block's: unchanged)
            b.valid_rows[: b.n] = 1
            b.valid_rows[b.n:] = 0
            b.valid_n = b.n

    def bind(self, io, b) -> None:
        io.input(self.name, b.valid_rows)
        io.before(lambda slot: self.set(b))

    def feed(self, feeds: dict, step, slot: int) -> None:
        self.set(step.buffers)
        feeds[self.name] = step.buffers.valid_rows


def decoder_features(dec: DecoderSpec, parts: KindParts) -> tuple[Part, list[Part]]:
    """The step parts the manifest names, built in this one place: the output part (the logits, or the head graph's
    input: a plain call's first output, as export/htp/calibrate.py's recorders read it), then the inputs and the
    other outputs."""
    output = HeadGraph(parts.hidden_output, dec.logits_output) if parts.hidden_output else Logits(dec.logits_output)
    features: list[Part] = [Embeds(dec)]
    if parts.token_rows_input:
        features.append(TokenRows(parts.token_rows_input, parts.token_scales_input))
    if parts.logit_rows_input:
        features.append(LogitRows(parts.logit_rows_input))
    if parts.argmax_output:
        features.append(Argmax(parts.argmax_output))
    if dec.row_input:
        features.append(RowInput(dec.row_input.input, dec.row_input.width))
    if dec.span_input:
        features.append(SpanInput(dec.span_input))
    if parts.valid_rows_input:
        features.append(ValidRows(parts.valid_rows_input))
    return output, features


def step_parts(kind, cache_part: Part, step_inputs: Part) -> list[Part]:
    """A step's parts in the order a plain call's outputs take (the output part's first, then the cache's)."""
    return [kind.output, cache_part, *kind.features, step_inputs]


class StepMask(Part):
    """A rows step's additive mask [ar, ctx + ar] (kv_cache.attention_mask, from slots), kept across calls: a step at a
    later slot than the last only unmasks the slots in between (one slot per decode step), else it is rebuilt."""

    def __init__(self, name: str, ar: int, ctx: int, dtype, neg: float | None):
        self.name = name
        self.array = np.zeros((ar, ctx + ar), dtype)
        self.ar, self.ctx, self.neg = ar, ctx, neg
        self.slot = -1  # the slot the array is for; -1: none yet

    def set(self, slot: int) -> None:
        if 0 <= self.slot <= slot:
            self.array[:, self.slot : slot] = 0  # the cache now also holds slots self.slot..slot-1
        else:
            attention_mask(slot, self.ar, self.ctx, self.array.dtype, out=self.array, neg=self.neg)
        self.slot = slot

    def bind(self, io, b) -> None:
        io.input(self.name, self.array)
        io.before(self.set)

    def feed(self, feeds: dict, step, slot: int) -> None:
        self.set(slot)
        feeds[self.name] = self.array


class EndSlot(Part):
    """gqa_in_place's step inputs: seqlens_k [1] int32 = the step's last slot, total_sequence_length [] int32 = that
    + 1 (GroupQueryAttention writes the step's rows at slots total - ar .. total - 1)."""

    def __init__(self, seqlens: str, total: str, ar: int):
        self.names, self.ar = (seqlens, total), ar
        self.seqlens, self.total = np.zeros(1, np.int32), np.zeros((), np.int32)
        # memoryviews: a decode step writes one scalar of each (a plain C store, where a numpy scalar index runs its
        # dtype machinery on caches a graph call left cold)
        self._seqlens, self._total = memoryview(self.seqlens), memoryview(self.total.reshape(1))

    def set(self, slot: int) -> None:
        self._seqlens[0] = slot + self.ar - 1
        self._total[0] = slot + self.ar

    def bind(self, io, b) -> None:
        io.input(self.names[0], self.seqlens)
        io.input(self.names[1], self.total)
        io.before(self.set)

    def feed(self, feeds: dict, step, slot: int) -> None:
        self.set(slot)
        feeds[self.names[0]], feeds[self.names[1]] = self.seqlens, self.total


class EndSlots(EndSlot):
    """A batch's step inputs (decoder.kind.batched): seqlens_k [B] int32 = each sequence's step's last slot,
    total_sequence_length [] int32 = the largest + 1 (runtime/decode/scheduler.py sets them row by row)."""

    def __init__(self, seqlens: str, total: str, batch: int):
        super().__init__(seqlens, total, 1)
        self.seqlens = np.zeros(batch, np.int32)
        self._seqlens = memoryview(self.seqlens)
