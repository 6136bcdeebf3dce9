"""Continuous batching: one decoder call advances every sequence that waits for a decode step.

    blocks = KVCache.batch_blocks(kv, n)                        # one cache for n sequences [layers, 2, n, ...], ...
    engines = [Engine(sessions, config, table, scale, KVCache.rows_of(blocks, b)) for b in range(n)]
    batch = BatchDecoder(sessions.decode, engines, blocks)       # engine.batch = batch for each
    gens = [e.generate(...) for e in engines]                   # each yields STEP (and token ids)
    ... advance each gen until it yields STEP; batch.run(); repeat   (serve/scheduler.py, batch/worker.py: Batcher)

Each sequence is an Engine of its own (its cache, its slots and positions, its prefix reuse, its sampler), whose
cache is row b of one shared HEADS cache: each attention layer's buffer [n, kv_heads, max_context, head_dim] and each
conv layer's window [n, width, channels] (LFM2), sequence b's [1, ...] a contiguous view of each, so its prefill
blocks (and a lookahead verify step) run as they do alone, bound to its own rows (a conv layer's rows per slot are
the sequence's own, kv_cache.ConvRows). Its decode steps go here instead (Engine.generate under Engine.batch): `submit` takes the token,
`run` makes one call of the batched graph (decoder.kind.batched, export/batch_dim.py) over the rows 0..k-1 (k: one
past the last waiting row), each row its sequence's token at its next slot and position (seqlens_k [k]: each
row's own; its conv windows loaded from its rows before slot `length`, ConvRows.load), and `logits` hands each its
row; after the call each advanced sequence stores its conv rows (out [k, 1, channels]) and moves its length
(kind.store). GroupQueryAttention attends per sequence, a conv layer's Conv runs over each sequence's window and
every other node works row by row, so a row's logits do not depend on the others'; the MatMulNBits weights are read
once per call for all rows. They may depend on the call's width, though: MatMulNBits computes one row by another
kernel than several (its float path on every CPU, its int8 path on AVX2-only ones), so batched_vlms probes the graph
at load (probe) and where one-row calls round apart every call runs at least 2 rows (min_rows): a sequence's answer
is then the same whatever the number of sequences decoding beside it (docs/server.md#continuous-batching).

A row that waits for nothing in a call (a sequence prefilling, idle, or finished) is computed too (cheaper than
splitting the call): it is fed zeros (zero conv windows too) and writes a junk K/V row at its slot `length`, one past
what its cache keeps, where its next write lands anyway (a full cache keeps one row less: it is rewound to
max_context - 1 first); its conv rows out are dropped.
"""

from __future__ import annotations

import time

import numpy as np

from .engine import Engine
from .kv_cache import KVCache
from .step import _ORT_DTYPES, BoundStep, StepBuffers


class BatchDecoder:
    def __init__(self, session, engines: list[Engine], blocks: list[np.ndarray]):
        """session: the batched decoder graph's (decoder.kind.batched); engines: the sequences, engine b over
        KVCache.rows_of(blocks, b); blocks: KVCache.batch_blocks. Sets each engine's batch."""
        kind = engines[0].kind
        kind.batch_inputs(1)  # (ValueError for a graph that takes one sequence per call)
        self.session, self.kind, self.engines, self.blocks = session, kind, engines, blocks
        self.row = {id(e): b for b, e in enumerate(engines)}
        self.pending: dict[int, int] = {}  # row -> the token its sequence feeds
        self._calls: dict[int, BoundStep] = {}  # rows k -> the call over rows 0..k-1
        self._last: BoundStep | None = None  # the last call (its logits and argmax: the rows' results)
        self._ran: set[int] = set()  # the rows it advanced
        self.run_s = 0.0  # time inside graph calls, accumulated
        self.calls = 0
        self.rows = 0  # rows that waited, summed over calls (rows / calls: the mean batch)
        self.widest = 0  # the most rows that waited in one call
        # every call computes at least min_rows rows (padded with idle rows): 2 where the probe found one-row calls
        # computing a row differently from multi-row ones (probe)
        self.min_rows = 1
        self.probed: dict | None = None  # probe()'s findings
        for e in engines:
            e.batch = self

    def submit(self, engine: Engine, token: int) -> None:
        """engine's sequence feeds token at its next slot in the next run."""
        if not 0 <= token < engine._vocab:
            raise IndexError(f"token id {token} out of range 0..{engine._vocab - 1}")
        self.pending[self.row[id(engine)]] = token

    def logits(self, engine: Engine) -> np.ndarray:
        """engine's row of the last run: logits [1, vocab] (a view the next run overwrites); its argmax row is
        engine's to pick from (Engine._pick)."""
        b = self.row[id(engine)]
        if b not in self._ran:
            raise RuntimeError("the batch has not run since this sequence handed it its step (drive the answers as "
                               "runtime/batch_engine.py says: BatchDecoder.run after each STEP)")
        step = self._last
        engine._argmax = step.buffers.argmax_ids[b : b + 1]
        return step.buffers.logits[b : b + 1]

    def _call(self, k: int) -> BoundStep:
        step = self._calls.get(k)
        if step is None:
            s, kind = self.session, self.kind
            ins = {i.name: i.type for i in s.get_inputs()}
            outs = {o.name: o.type for o in s.get_outputs()}
            dec = kind.dec
            buffers = StepBuffers(dec, kind, k, _ORT_DTYPES[ins[dec.embeds_input]], _ORT_DTYPES[outs[dec.logits_output]], k)
            # rows 0..k-1: each attention layer's [k, ...], each conv layer's windows [k, width, channels] (its rows
            # out: the staging [k, 1, channels]); the conv rows this cache would hold are never written
            cache = KVCache(self.engines[0].kv_spec, kind.layout, self.engines[0].cache.dtype,
                            blocks=KVCache.rows_of(self.blocks, 0, k))
            step = self._calls[k] = BoundStep(s, kind, cache, kind.kv.max_context, k, buffers,
                                              inputs=kind.batch_inputs(k))
        return step

    def run(self) -> None:
        """One decoder call for the rows submitted since the last run; each of their caches advances one slot.
        Raises what the call raises (then no sequence advanced; the pending rows are dropped)."""
        pending, self.pending = self.pending, {}
        self._ran = set()
        if not pending:
            return
        k = min(max(max(pending) + 1, self.min_rows), len(self.engines))
        step = self._call(k)
        b = step.buffers
        seqlens, top = step.inputs.seqlens, self.kind.kv.max_context
        int8 = self.engines[0]._read_row is not None
        for r in range(k):
            e = self.engines[r]
            n = e.cache.length
            token = pending.get(r)
            if token is None:  # a row that waits for nothing: zeros, a junk row at slot n (kept rows untouched)
                if n >= top:
                    e.cache.rewind(top - 1)
                    n = top - 1
                b.embeds[r] = 0
                if int8:
                    b.token_scales[r] = 0
                b.positions[:, r] = 0
                e.cache.load_idle()  # (zero conv windows; its conv rows out are dropped)
            else:
                e.cache.load_windows(n)  # its conv windows: the rows before slot n
                if int8:
                    e._read_row(token, memoryview(b.token_rows[r]))
                    b.token_scales[r] = e._scales[token]
                else:
                    e.embed_into(token, b.embeds[r])
                b.positions[:, r] = e.cache.next_position()
            seqlens[r] = n
        step.inputs.total[...] = int(seqlens.max()) + 1
        t = time.perf_counter()
        step.session.run_with_iobinding(step.io)
        dt = time.perf_counter() - t
        self.run_s += dt
        self.calls += 1
        self.rows += len(pending)
        self.widest = max(self.widest, len(pending))
        self._last, self._ran = step, set(pending)
        for r in pending:
            e = self.engines[r]
            self.kind.store(e.cache, [rows[r] for rows in step.staged or ()], 1, b.positions[:, r : r + 1])
            e.run_s += dt

    def probe(self) -> dict:
        """Whether a row's logits depend on how many rows its call computes, on this CPU and this graph's kernels, and
        the call width that makes them not: min_rows (1: any; 2: calls of 2 rows or more, a sequence alone then padded
        with an idle row; n: every call over all rows), set here and returned with the findings. Run on fresh
        caches (they are reset after): every row one step in (so that the probed calls attend over a stored row),
        then the same tokens (two alternating ids) through calls of widths 1..5, n/2, n - 1 and n and a call of
        n rows of which only the last waits; each row's logits compared bit for bit with the n-row call's.

        Where int8-compute MatMulNBits (the *a8* precisions) runs its AVX2 kernels (a CPU without AVX-512 VNNI or
        AVX-VNNI) a one-row call takes another path than a multi-row one and rounds differently (SmolLM2-135M w4a8:
        logits up to 0.57 apart here); so does its float path (w4a16) on every CPU (GEMV vs GEMM: 4e-5); calls of 2
        and more rows agree bit for bit (docs/server.md#continuous-batching). A sequence alone through the batch then
        answers as it does among others. A call that raises here raises from batched_vlms (the graph cannot run)."""
        n = len(self.engines)
        vocab = self.engines[0]._vocab
        ids = (vocab // 3, vocab // 2)

        def call(rows: list[int]) -> dict[int, np.ndarray]:
            lengths = [e.cache.length for e in self.engines]
            for r in rows:
                self.submit(self.engines[r], ids[r % 2])
            self.run()
            out = {r: self.logits(self.engines[r]).copy() for r in rows}
            for e, length in zip(self.engines, lengths):
                e.cache.rewind(length)
            return out

        def diff(got: dict[int, np.ndarray]) -> float:
            return max(float(np.abs(got[r] - ref[r]).max()) if not np.array_equal(got[r], ref[r]) else 0.0
                       for r in got)

        self.min_rows = 1
        for e in self.engines:
            e.cache.reset()
        try:
            self.pending = {r: ids[1] for r in range(n)}
            self.run()  # every cache one row in
            ref = call(list(range(n)))
            one = diff(call([0]))
            widths = sorted({*range(2, min(n, 6)), n // 2, n - 1} - {0, 1, n})
            multi = max([diff(call(list(range(k)))) for k in widths], default=0.0)
            alone = diff(call([n - 1]))  # the others idle (fed zeros): does a row depend on its neighbours' data?
        finally:
            for e in self.engines:
                e.cache.reset()
                e.run_s = 0.0
            self.pending, self._ran, self._last = {}, set(), None
            self.run_s, self.calls, self.rows, self.widest = 0.0, 0, 0, 0
        if alone:  # a row depends on the other rows' data: no call width makes the answers independent of the load
            self.min_rows = 1
        elif multi:  # the widths disagree among themselves: every call over every row
            self.min_rows = n
        else:
            self.min_rows = 2 if one else 1
        self.probed = {"one_row_diff": one, "multi_row_diff": multi, "neighbour_diff": alone,
                       "min_rows": self.min_rows, "invariant": not alone}
        return self.probed


def batched_vlms(bundle, n: int, load_s: float = 0.0, **vlm_options) -> tuple[list, BatchDecoder | None]:
    """n VLMs over one opened bundle's sessions (a server's slots, a batch job's sequences) and their BatchDecoder:
    where the decoder graph takes a batch (decoder.kind.batched) and n > 1, their caches are the rows of one cache and
    their decode steps go through one call per step (their answers yield STEP: drive them as serve/scheduler.py
    does); else (a graph of one sequence per call: the rows kinds, the NPU's static graphs, or a bundle exported
    before) each VLM has a cache of its own and runs its own steps, and the batch is None."""
    from .pipeline import VLM

    m = bundle.manifest
    if n < 2 or not m.decoder.kind.parts().batched:
        return [VLM(bundle, load_s, **vlm_options) for _ in range(n)], None
    blocks = KVCache.batch_blocks(m.kv, n)
    vlms = [VLM(bundle, load_s, cache_blocks=KVCache.rows_of(blocks, b), **vlm_options) for b in range(n)]
    batch = BatchDecoder(bundle.sessions["decode"], [v.engine for v in vlms], blocks)
    batch.probe()
    return vlms, batch
