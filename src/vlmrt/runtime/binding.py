"""ORT I/O binding for decoder steps: no per-step allocation and no copy of the KV cache at the graph edge.

One `BoundStep` per (session, context, AR). Its inputs are OrtValues over host buffers that live as long as
the step: the embeddings / positions / mask buffers, which the host overwrites in place before each call,
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


class BoundStep:
    def __init__(self, session, dec, cache: KVCache, ctx: int, ar: int, neg: float | None):
        import onnxruntime as ort

        self.session, self.ctx, self.ar, self.neg = session, ctx, ar, neg
        self.io = io = session.io_binding()
        ins = {i.name: i for i in session.get_inputs()}
        outs = {o.name: o for o in session.get_outputs()}
        io_dtype = _ORT_DTYPES[ins[dec.embeds_input].type]
        self.embeds = np.zeros((ar, dec.hidden_size), io_dtype)
        self.positions = np.zeros(ar, _ORT_DTYPES[ins[dec.positions_input].type])
        self.mask = np.zeros((ar, ctx + ar), _ORT_DTYPES[ins[dec.mask_input].type])
        self.logits = np.zeros((1 if dec.last_logits else ar, dec.vocab_size), _ORT_DTYPES[outs[dec.logits_output].type])
        self.rows = np.zeros((cache.spec.layers, 2, ar, cache.spec.dim), cache.dtype)
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
