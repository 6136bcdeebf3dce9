"""The one scheduler: sequences (runtime/decode/sequence.py) admitted onto cache rows, advanced a round at a time.

    sched = Scheduler(DecoderSessions(decode, prefill), DecoderConfig(kv, decoder, eos_ids), embed_table, rows=4)
    sched.probe()                       # where the graph takes a batch and rows > 1: the call width that keeps an
                                        # answer independent of the load (min_rows)
    sched.add(Sequence(embeds, mode="hybrid", max_new_tokens=64, sampler=...), row=None)   # a free row
    advanced = sched.step()             # one round; each advanced sequence's new ids: seq.take()
    for token in sched.generate(embeds, max_new_tokens=64):   # one sequence through the same rounds
        ...
    sched.last                          # GenerationStats of the last sequence that ended

A round (step): each sequence still in its prompt runs one prompt block (chunked prefill: a block per round, so a
long prompt does not hold the others' decode steps; the last block's logits give its first token); then each
decoding sequence either verifies lookahead drafts (its own call, CacheRow.verify) or waits for the round's decode
call: where the decoder graph takes a batch (decoder.kind.batched: the CPU's gqa_in_place graph, export/batch_dim.py)
ONE call over the rows 0..k-1 (k: one past the last waiting row), each row its sequence's token at its next slot and
position (seqlens_k [k]: each row's own; its conv windows loaded from its rows before slot `length`), the logits
row b its sequence's; else (the rows kinds: the NPU's static graphs, `--attention portable`; a bundle exported
before the batch dimension; a session that cannot bind) one call per waiting row (CacheRow.decode_token). Then the
sequences that ended (EOS, length, a full cache, a call that failed, a grammar complete) retire; their rows stay as
they are (a later sequence on the row may keep a prefix of them: CacheRow.reusable). One sequence is the case B = 1 of
the same round. A sequence with a grammar (seq.constraint, runtime/decode/grammar.py) picks from its row of the same
logits under its own mask (constrained and free sequences share the call), its lookahead drafts cut to what the
grammar allows and the grammar rolled back after a verify call.

The rows: where the graph takes a batch, one cache for all (KVCache.batch_blocks): each attention layer's buffer
[rows, kv_heads, max_context, head_dim] and each conv layer's window [rows, width, channels] (LFM2), row b's cache a
contiguous view of each (KVCache.rows_of), so its prompt blocks and verify steps run bound to its own rows; else a
cache per row. GroupQueryAttention attends per sequence, a conv layer's Conv runs over each sequence's window and
every other node works row by row, so a row's logits do not depend on the others'; the MatMulNBits weights are read
once per call for all rows. They may depend on the call's width, though: MatMulNBits computes one row by another
kernel than several (its float path on every CPU, its int8 path on AVX2-only ones), so a scheduler of several rows
probes the graph (probe) and where one-row calls round apart every call runs at least 2 rows (min_rows): a
sequence's answer is then the same whatever the number of sequences decoding beside it (docs/server.md#continuous-
batching). A scheduler of one row (VLM.load's) makes one-row calls: the answer of a sequence alone.
A row that waits for nothing in a call (a sequence prefilling, idle, or none) is computed too (cheaper than
splitting the call): it is fed zeros (zero conv windows too) and writes a junk K/V row at its slot `length`, one past
what its cache keeps, where its next write lands anyway (a full cache keeps one row less: it is rewound to
max_context - 1 first); its conv rows out are dropped.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from .cache_row import CacheRow, DecoderConfig, DecoderSessions
from .decoder_kinds import decoder_kind
from .embedding import TokenEmbedding
from .grammar import Constraint
from .kv_cache import KVCache
from .logprobs import token_logprobs
from .lookahead import PromptLookup
from .sampler import Sampler
from .sequence import GenerationStats, Sequence
from .spans import block_end
from .step import _ORT_DTYPES, BoundStep, StepBuffers, can_bind


class BatchCallFailed(RuntimeError):
    """A batched decode call raised: each sequence it was to advance ends with this error (its __cause__: what the
    call raised); the call may have written part of their rows, so they are not retried."""


class Scheduler:
    def __init__(self, sessions: DecoderSessions, config: DecoderConfig, embed_table,
                 embed_scale: np.ndarray | None = None, rows: int = 1):
        """embed_table: [vocab, hidden] rows by token id (an ndarray, or the bundle's EmbeddingRows: pread);
        embed_scale: [vocab] when the table is int8 rows. rows: the sequences it holds at once (>= 1)."""
        if rows < 1:
            raise ValueError("a scheduler needs at least one row")
        kv, dec = config.kv, config.decoder
        self.kind = kind = decoder_kind(dec, kv)
        kind.check_lookahead(config.lookahead)
        if config.lookahead and kind.verify_ar and sessions.verify is None:
            raise ValueError("lookahead on static graphs needs the bundle's verify graph session")
        if bool(kind.hidden_output) != (sessions.head is not None):
            raise ValueError("decoder.kind.hidden_output and a head graph session go together")
        self.sessions, self.config, self.kv = sessions, config, kv
        self.lookahead = config.lookahead
        self.eos = set(config.eos_ids)
        self.embedding = TokenEmbedding(embed_table, embed_scale, config.io_dtype, bool(kind.token_rows_input))
        self._batch = _takes_a_batch(kind)
        self.blocks = KVCache.batch_blocks(kv, rows) if self.batched else None
        self.rows = [CacheRow(sessions, config, self.embedding,
                              None if self.blocks is None else KVCache.rows_of(self.blocks, b), kind)
                     for b in range(rows)]
        self.seqs: list[Sequence | None] = [None] * rows  # the sequence on each row
        self.last = GenerationStats()  # the last ended sequence's
        self._calls: dict[int, _BatchCall] = {}  # rows k -> the batched call over rows 0..k-1
        self.run_s = 0.0  # time inside batched calls, accumulated
        self.calls = 0  # batched calls
        self.rows_decoded = 0  # rows that waited, summed over batched calls (/ calls: the mean batch)
        self.widest = 0  # the most rows that waited in one batched call
        # every batched call computes at least min_rows rows (padded with idle rows): 2 where the probe found one-row
        # calls computing a row differently from multi-row ones (probe)
        self.min_rows = 1
        self.probed: dict | None = None  # probe()'s findings

    @property
    def batched(self) -> bool:
        """Whether one decoder call advances every decoding row: the graph takes a batch (decoder.kind.batched) and
        its session can bind (a plain session.run, as the torch reference's or a test's, runs one row per call)."""
        return self._batch and can_bind(self.sessions.decode)

    def embed(self, ids) -> np.ndarray:
        """Token embeddings [n, hidden] of ids (TokenEmbedding.embed)."""
        return self.embedding.embed(ids)

    # --- sequences in and out ---
    def free_row(self) -> int | None:
        return next((r for r, s in enumerate(self.seqs) if s is None), None)

    def add(self, seq: Sequence, row: int | None = None) -> Sequence:
        """Admit seq onto row (None: the first free one): checks its prompt (ValueError, ContextOverflow) and readies
        the row's cache (its rows 0..seq.start-1 kept). Its first prompt block runs in the next step."""
        row = self.free_row() if row is None else row
        if row is None or self.seqs[row] is not None:
            raise RuntimeError(f"no free row for a sequence (row {row} is busy)")
        seq.row, seq.began = row, time.perf_counter()
        seq.stats = GenerationStats(prompt_tokens=int(seq.embeds.shape[0]))
        if seq.max_new_tokens <= 0:
            seq.stop("length")
            self.last = seq.stats
            return seq
        seq.positions = self.rows[row].begin(seq.embeds, seq.mode, seq.start, seq.positions)
        if self.lookahead and seq.sampler.cfg.temperature == 0 and seq.prompt_ids:
            seq.drafter = PromptLookup(self.lookahead, seq.prompt_ids, adapt=not self.kind.verify_ar)  # a static verify: fixed cost
        self.seqs[row] = seq
        return seq

    def remove(self, seq: Sequence) -> None:
        """seq leaves its row before it ended (a client gone, a stop string): stop_reason "cancelled"."""
        seq.stop("cancelled")
        if 0 <= seq.row < len(self.seqs) and self.seqs[seq.row] is seq:
            self.seqs[seq.row] = None

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.seqs if s is not None]

    # --- one round ---
    def step(self) -> list[Sequence]:
        """One round over the admitted sequences (see the module's doc); returns those it advanced or ended, in row
        order (their new ids: take()). A sequence whose own call raised ends with stop_reason "error" and the
        exception in seq.error; a batched call that raised ends every sequence it was to advance so."""
        advanced, decoding = [], []
        for seq in self.running:
            advanced.append(seq)
            if seq.prefilling:
                self._prompt_block(seq)
                if seq.prefilling or seq.done:
                    continue
            decoding.append(seq)
        if decoding:
            self._decode(decoding)
        for seq in advanced:
            if seq.done:
                self.seqs[seq.row] = None
                self.last = seq.stats
        return advanced

    def _prompt_block(self, seq: Sequence) -> None:
        row, ar, b = self.rows[seq.row], self.rows[seq.row].blocks(seq.mode), seq.next_block
        try:
            costs = row.cache.costs()  # (empty but for a state that keeps snapshots)
            n = len(seq.embeds)
            e = block_end(seq.spans, b, ar, n)  # (b + ar, unless that splits an image span)
            logits = row.block(seq.mode, seq.embeds[b:e], seq.positions[:, b:e],
                               None if seq.rows is None else seq.rows[b:e], None if seq.spans is None else seq.spans[b:e])
            if costs:
                after = row.cache.costs()
                seq.stats.state_snapshots += int(after["snapshots"] - costs["snapshots"])
                seq.stats.snapshot_s += after["snapshot_s"] - costs["snapshot_s"]
            seq.next_block = e
            if seq.prefilling:
                return
            row.end(seq.mode, seq.start, n)
            tokens = [row.pick(seq.sampler, logits[-1][None], constraint=seq.constraint)]
            logprobs = _logprobs(seq, logits[-1:], tokens)
        except Exception as e:
            seq.stop("error", e)
            return
        seq.stats.prefill_s = time.perf_counter() - seq.began
        self._emit(seq, tokens, logprobs)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        seq.emit(tokens, self.eos, logprobs)
        if not seq.done and self.rows[seq.row].cache.length >= self.kv.max_context:
            seq.stop("context")

    def _decode(self, decoding: list[Sequence]) -> None:
        t0 = time.perf_counter()
        waiting: dict[int, Sequence] = {}
        for seq in decoding:
            row, st = self.rows[seq.row], seq.stats
            drafts = None
            if seq.drafter:  # drafts: no more than the answer and the cache have room for, none past an EOS
                room = min(seq.max_new_tokens - st.generated_tokens, self.kv.max_context - row.cache.length) - 1
                drafts = seq.drafter.propose(room)
            if drafts and not seq.ignore_eos:
                drafts = next((drafts[:i] for i, d in enumerate(drafts) if d in self.eos), drafts)
            if drafts and seq.constraint is not None:  # drafts the grammar allows, from the first
                drafts = drafts[: seq.constraint.valid_prefix(drafts)]
            if not drafts:
                waiting[seq.row] = seq
                continue
            t, run0, replays0, replay0 = time.perf_counter(), row.run_s, row.replays, row.replay_s
            rows = None if seq.logprobs is None else []
            try:
                tokens = row.verify(seq.token, drafts, seq.sampler, seq.constraint, rows)
            except Exception as e:
                seq.stop("error", e)
                continue
            st.state_replays += row.replays - replays0
            st.replay_s += row.replay_s - replay0
            seq.drafter.feedback(len(tokens) - 1, len(drafts))
            st.drafted_tokens += len(drafts)
            st.accepted_tokens += len(tokens) - 1
            dt = time.perf_counter() - t
            st.decode_s += dt
            st.decode_run_s += row.run_s - run0
            st.step_times.append(dt)
            self._emit(seq, tokens, _logprobs(seq, rows, tokens))
        if not waiting:
            return
        if self.batched:
            try:
                step, run_s = self.batch_call({r: s.token for r, s in waiting.items()})
            except Exception as e:
                failed = BatchCallFailed("batched decode step failed")
                failed.__cause__ = e
                for seq in waiting.values():
                    seq.stop("error", failed)
                return
            b = step.buffers
            for r, seq in waiting.items():
                row = self.rows[r]
                try:
                    tokens = [row.pick(seq.sampler, b.logits, r, b.argmax_ids, seq.constraint)]
                except Exception as e:  # (a grammar that allows nothing)
                    seq.stop("error", e)
                    continue
                self._decoded(seq, row, tokens, t0, run_s, _logprobs(seq, b.logits[r : r + 1], tokens))
            return
        for r, seq in waiting.items():  # one sequence per call
            row = self.rows[r]
            run0 = row.run_s
            try:
                logits = row.decode_token(seq.token)
                tokens = [row.pick(seq.sampler, logits, constraint=seq.constraint)]
            except Exception as e:
                seq.stop("error", e)
                continue
            self._decoded(seq, row, tokens, t0, row.run_s - run0, _logprobs(seq, logits[-1:], tokens))
            t0 = time.perf_counter()

    def _decoded(self, seq: Sequence, row: CacheRow, tokens: list[int], t0: float, run_s: float,
                 logprobs: list | None) -> None:
        row.decoded(seq.mode)
        st = seq.stats
        dt = time.perf_counter() - t0
        st.decode_s += dt
        st.decode_run_s += run_s
        st.step_times.append(dt)
        self._emit(seq, tokens, logprobs)

    # --- the batched call ---
    def _call(self, k: int) -> "_BatchCall":
        call = self._calls.get(k)
        if call is None:
            s, kind = self.sessions.decode, self.kind
            ins = {i.name: i.type for i in s.get_inputs()}
            outs = {o.name: o.type for o in s.get_outputs()}
            dec = kind.dec
            buffers = StepBuffers(dec, kind, k, _ORT_DTYPES[ins[dec.embeds_input]], _ORT_DTYPES[outs[dec.logits_output]], k)
            # rows 0..k-1: each attention layer's [k, ...], each conv layer's windows [k, width, channels] (its rows
            # out: the staging [k, 1, channels]); the conv rows this cache would hold are never written
            cache = KVCache(self.kv, kind.layout, self.rows[0].cache.dtype, blocks=KVCache.rows_of(self.blocks, 0, k))
            step = BoundStep(s, kind, cache, self.kv.max_context, k, buffers, inputs=kind.batch_inputs(k))
            call = self._calls[k] = _BatchCall(step)
        return call

    def batch_call(self, pending: dict[int, int]) -> tuple[BoundStep, float]:
        """One call of the batched graph: row r feeds pending[r] at its next slot, each such row's cache advances one
        slot (the others are idle rows). Returns the call (its buffers hold each row's logits and argmax) and its
        time. Raises what the call raises (then no row advanced; a token out of the vocabulary raises IndexError)."""
        k = min(max(max(pending) + 1, self.min_rows), len(self.rows))
        call = self._call(k)
        step, b, emb = call.step, call.step.buffers, self.embedding
        top, last = self.kv.max_context, 0
        for r in range(k):
            c = self.rows[r].cache
            n = c.length
            token = pending.get(r)
            if token is None:  # a row that waits for nothing: zeros, a junk row at slot n (kept rows untouched)
                if n >= top:
                    c.rewind(top - 1)
                    n = top - 1
                emb.clear_row(b, r)
                b.positions[:, r] = 0
                c.load_idle()  # (zero conv windows; its conv rows out are dropped)
            else:
                c.load_windows(n)  # its conv windows: the rows before slot n
                emb.into_row(token, b, r, call.embeds[r])
                call.set_position(r, c.next_position())
            call.seqlens[r] = n
            last = n if n > last else last
        call.total[0] = last + 1
        t = time.perf_counter()
        step.session.run_with_iobinding(step.io)
        dt = time.perf_counter() - t
        self.run_s += dt
        self.calls += 1
        self.rows_decoded += len(pending)
        self.widest = max(self.widest, len(pending))
        store, staged = self.kind.store, step.staged
        for r in pending:
            row = self.rows[r]
            store(row.cache, [rows[r] for rows in staged or ()], 1, call.positions[r])
            row.run_s += dt
        return step, dt

    def probe(self) -> dict:
        """Whether a row's logits depend on how many rows its call computes, on this CPU and this graph's kernels, and
        the call width that makes them not: min_rows (1: any; 2: calls of 2 rows or more, a sequence alone then padded
        with an idle row; n: every call over all rows), set here and returned with the findings (None where the graph
        takes one sequence per call or there is one row). Run on fresh caches (they are reset after): every row one
        step in (so that the probed calls attend over a stored row), then the same tokens (two alternating ids)
        through calls of widths 1..5, n/2, n - 1 and n and a call of n rows of which only the last waits; each row's
        logits compared bit for bit with the n-row call's.

        Where int8-compute MatMulNBits (the *a8* precisions) runs its AVX2 kernels (a CPU without AVX-512 VNNI or
        AVX-VNNI) a one-row call takes another path than a multi-row one and rounds differently (SmolLM2-135M w4a8:
        logits up to 0.57 apart here); so does its float path (w4a16) on every CPU (GEMV vs GEMM: 4e-5); calls of 2
        and more rows agree bit for bit (docs/server.md#continuous-batching). A sequence alone then answers as it
        does among others. A call that raises here raises (the graph cannot run)."""
        n = len(self.rows)
        if not self.batched or n < 2:
            return None
        vocab = self.embedding.vocab
        ids = (vocab // 3, vocab // 2)
        caches = [row.cache for row in self.rows]

        def call(rows: list[int]) -> dict[int, np.ndarray]:
            lengths = [c.length for c in caches]
            step, _ = self.batch_call({r: ids[r % 2] for r in rows})
            out = {r: step.buffers.logits[r : r + 1].copy() for r in rows}
            for c, length in zip(caches, lengths):
                c.rewind(length)
            return out

        def diff(got: dict[int, np.ndarray]) -> float:
            return max(float(np.abs(got[r] - ref[r]).max()) if not np.array_equal(got[r], ref[r]) else 0.0
                       for r in got)

        self.min_rows = 1
        for c in caches:
            c.reset()
        try:
            self.batch_call({r: ids[1] for r in range(n)})  # every cache one row in
            for c in caches:  # (where a state is not per slot, the probed calls rewind to this snapshot)
                c.checkpoint()
            ref = call(list(range(n)))
            one = diff(call([0]))
            widths = sorted({*range(2, min(n, 6)), n // 2, n - 1} - {0, 1, n})
            multi = max([diff(call(list(range(k)))) for k in widths], default=0.0)
            alone = diff(call([n - 1]))  # the others idle (fed zeros): does a row depend on its neighbours' data?
        finally:
            for row in self.rows:
                row.cache.reset()
                row.run_s = 0.0
            self.run_s, self.calls, self.rows_decoded, self.widest = 0.0, 0, 0, 0
        if alone:  # a row depends on the other rows' data: no call width makes the answers independent of the load
            self.min_rows = 1
        elif multi:  # the widths disagree among themselves: every call over every row
            self.min_rows = n
        else:
            self.min_rows = 2 if one else 1
        self.probed = {"one_row_diff": one, "multi_row_diff": multi, "neighbour_diff": alone,
                       "min_rows": self.min_rows, "invariant": not alone}
        return self.probed

    # --- one sequence ---
    def generate(self, prompt_embeds: np.ndarray, *, mode: str = "hybrid", max_new_tokens: int = 256,
                 sampler: Sampler | None = None, ignore_eos: bool = False, start: int = 0,
                 prompt_ids: list[int] | None = None, positions: np.ndarray | None = None,
                 rows: np.ndarray | None = None, row: int | None = None,
                 constraint: Constraint | None = None, spans: np.ndarray | None = None) -> Iterator[int]:
        """Yield the generated ids of one sequence (EOS is not yielded), run through step() (with whatever else the
        scheduler holds); its stats land in self.last when it ends. start > 0: a prefix reuse, prompt_embeds are the
        rows from slot start on (CacheRow.begin). positions: their rope positions; rows: their row input; spans: their
        image spans (see CacheRow.prefill). prompt_ids: the whole prompt's ids (from slot 0), where lookahead looks up drafts;
        lookahead runs with them and a greedy sampler only. constraint: the grammar its tokens are held to
        (runtime/decode/grammar.py). A call that fails the sequence raises here."""
        kw = {} if sampler is None else {"sampler": sampler}
        seq = self.add(Sequence(prompt_embeds, mode, max_new_tokens, ignore_eos=ignore_eos, start=start,
                                prompt_ids=prompt_ids, positions=positions, rows=rows, constraint=constraint,
                                spans=spans, **kw), row)
        try:
            while not seq.done:
                self.step()
                if seq.error is not None:
                    raise seq.error
                yield from seq.take()
        finally:
            if not seq.done:
                self.remove(seq)


class _BatchCall:
    """The batched call over rows 0..k-1 (a BoundStep of AR k over their cache rows) and, made once, the views a
    round writes its scalars through: memoryviews of seqlens_k, total_sequence_length and (one rope row) the
    positions (a memoryview item store is a plain C store, where numpy's scalar indexing runs its dtype machinery on
    caches a graph call left cold), each row's embeddings row and positions column."""

    def __init__(self, step: BoundStep):
        b = step.buffers
        self.step = step
        self.seqlens = memoryview(step.inputs.seqlens)
        self.total = memoryview(step.inputs.total.reshape(1))
        self.embeds = [b.embeds[r] for r in range(b.ar)]
        self.positions = [b.positions[:, r : r + 1] for r in range(b.ar)]  # (what KVCache.advance keeps)
        self._position = memoryview(b.positions.reshape(-1)) if b.positions.shape[0] == 1 else None
        self._positions = b.positions

    def set_position(self, r: int, p: int) -> None:
        """Row r's position (every rope row: a generated token is text)."""
        if self._position is not None:
            self._position[r] = p
        else:
            self._positions[:, r] = p


def _logprobs(seq: Sequence, rows, tokens: list[int]) -> list | None:
    """Each token's log probabilities from the logits row it was picked from (rows[i]: tokens[i]'s), where the
    sequence asked for them (seq.logprobs); None (nothing computed) where it did not."""
    if seq.logprobs is None:
        return None
    return [token_logprobs(row, t, seq.logprobs) for row, t in zip(rows, tokens)]


def _takes_a_batch(kind) -> bool:
    """Whether one call of the decoder graph advances several sequences (decoder.kind.batched)."""
    try:
        kind.batch_inputs(1)
    except ValueError:
        return False
    return True
