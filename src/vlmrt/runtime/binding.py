"""ORT I/O binding for decoder steps: no per-step allocation and no copy of the KV cache at the graph edge.

One `BoundStep` per (session, context, AR). Its inputs are OrtValues over host buffers that live as long as
the step: the embeddings / positions / mask buffers (all but the mask shared by the steps of one AR,
`StepBuffers`), which the host overwrites in place before each call,
and prefixes of the KV cache block (runtime/kv_cache.py `KVCache.data`), which the graph reads where they
are. Its outputs are OrtValues over a preallocated logits buffer and one staging block
[layers, 2, ar, dim] for the new K/V rows; after the call the host moves the valid rows into the cache
with one copy (`KVCache.write_block`). Plain `session.run` instead wraps 60+ arrays and allocates
the logits and 60 row outputs on every step.

Used for sessions that have `io_binding` (onnxruntime's); fakes in tests take the plain path.
`VLMRT_IO_BINDING=0` forces the plain path (to measure the difference).
"""

from __future__ import annotations

import os

import numpy as np

from .kv_cache import KVCache, attention_mask

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def enabled(session) -> bool:
    return hasattr(session, "io_binding") and os.environ.get("VLMRT_IO_BINDING", "1") != "0"


def buffers_key(session, dec, ar: int) -> tuple:
    """Steps with the same AR and I/O types can share their StepBuffers (steps never run concurrently)."""
    ins = {i.name: i.type for i in session.get_inputs()}
    outs = {o.name: o.type for o in session.get_outputs()}
    return ar, ins[dec.embeds_input], ins[dec.positions_input], outs[dec.logits_output]


class StepBuffers:
    """The host buffers of a step that do not depend on its cache length: embeddings, positions, logits and the
    staging block for the new K/V rows. Shared by the bound steps of one AR across context lengths, so that the
    count of (context, AR) shapes does not multiply the memory (an AR=32 staging block is 1.5 MB for SmolLM2)."""

    def __init__(self, session, dec, cache: KVCache, ar: int):
        _, embeds, positions, logits = buffers_key(session, dec, ar)
        self.embeds = np.zeros((ar, dec.hidden_size), _ORT_DTYPES[embeds])
        self.positions = np.zeros(ar, _ORT_DTYPES[positions])
        self.logits = np.zeros((1 if dec.last_logits else ar, dec.vocab_size), _ORT_DTYPES[logits])
        self.rows = np.zeros((cache.spec.layers, 2, ar, cache.spec.dim), cache.dtype)


class BoundStep:
    def __init__(self, session, dec, cache: KVCache, ctx: int, ar: int, neg: float | None,
                 buffers: StepBuffers | None = None):
        import onnxruntime as ort

        self.session, self.ctx, self.ar, self.neg = session, ctx, ar, neg
        self.io = io = session.io_binding()
        ins = {i.name: i for i in session.get_inputs()}
        b = buffers or StepBuffers(session, dec, cache, ar)
        self.embeds, self.positions, self.logits, self.rows = b.embeds, b.positions, b.logits, b.rows
        self.mask = np.zeros((ar, ctx + ar), _ORT_DTYPES[ins[dec.mask_input].type])
        self._keep = []  # OrtValues (and through them the arrays) bound to io

        def bind_in(name, arr):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            io.bind_ortvalue_input(name, v)

        def bind_out(name, arr):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._keep.append(v)
            io.bind_ortvalue_output(name, v)

        bind_in(dec.embeds_input, self.embeds)
        bind_in(dec.positions_input, self.positions)
        bind_in(dec.mask_input, self.mask)
        s = cache.spec
        for i in range(s.layers):
            bind_in(s.key_input.format(layer=i), cache.data[i, 0, :ctx])  # contiguous prefix: no copy
            bind_in(s.value_input.format(layer=i), cache.data[i, 1, :ctx])
            bind_out(s.key_output.format(layer=i), self.rows[i, 0])
            bind_out(s.value_output.format(layer=i), self.rows[i, 1])
        bind_out(dec.logits_output, self.logits)
        self._range = np.arange(ar, dtype=self.positions.dtype)

    def __call__(self, embeds: np.ndarray, pos: int) -> np.ndarray:
        """embeds [n <= ar, hidden] at positions pos.. -> logits [ar, vocab] (a view of the reused buffer)."""
        n = embeds.shape[0]
        self.embeds[:n] = embeds
        if n < self.ar:
            self.embeds[n:] = 0
        np.add(self._range, pos, out=self.positions)
        attention_mask(pos, self.ar, self.ctx, self.mask.dtype, out=self.mask, neg=self.neg)
        self.session.run_with_iobinding(self.io)
        return self.logits
