"""One sequence's cache rows and the decoder calls bound to them: a prompt's blocks, a lookahead verify step, a
decode step of one row per call (graphs that take one sequence per call), teacher-forced scoring.

    row = CacheRow(DecoderSessions(decode, prefill), DecoderConfig(manifest.kv, manifest.decoder, eos_ids), embedding)
    logits = row.prefill(embeds, "hybrid", positions=None)   # [vocab], the last prompt token's
    logits = row.decode_token(token)                         # [rows, vocab] (the last row: the next token's)
    rows = row.score(embeds, tokens)                         # [len(tokens), vocab]

A row holds no sequence: the scheduler (runtime/decode/scheduler.py) admits a Sequence onto a row, runs its prompt block by
block (begin, block, end) and its decode steps, batched over rows where the graph takes a batch. The rows stay after
the sequence retires, so the next one on the same row may keep a prefix of them (reusable: prefix reuse).

Sessions only need `run(output_names, feeds) -> list[np.ndarray]` (onnxruntime.InferenceSession or a fake in tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ...format.manifest import DecoderSpec, KVSpec
from .decoder_kinds import decoder_kind
from .embedding import TokenEmbedding
from .kv_cache import KVCache
from .grammar import Constraint
from .sampler import Sampler
from .spans import block_end
from .step import PlainStep, StepBuffers, make_step

MODES = ("kv", "hybrid")


class Session(Protocol):
    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...


class ContextOverflow(ValueError):
    pass


def check_lookahead(dec: DecoderSpec, k: int) -> None:
    """A draft length k the decoder can verify (ValueError if not): the symbolic-AR kinds return every row's logits
    when asked (logit_rows) and take 1 + k tokens; rows_static graphs (the HTP target) verify with their verify graph
    (decoder.kind.verify_ar), which takes 1 + k tokens."""
    decoder_kind(dec, None).check_lookahead(k)


@dataclass
class DecoderSessions:
    """The decoder graphs' sessions (onnxruntime.InferenceSession, or anything with `run`): decode always; prefill
    for hybrid mode (the same session as decode for the symbolic-AR kinds); verify: a rows_static bundle's lookahead
    verify graph (decoder.kind.verify_ar); head: the lm head's own graph (decoder.kind.hidden_output)."""

    decode: Session
    prefill: Session | None = None
    verify: Session | None = None
    head: Session | None = None

    def __getitem__(self, graph: str):
        return getattr(self, graph)


@dataclass
class DecoderConfig:
    """What the rows and the scheduler are built from, besides the sessions and the embedding table: the manifest's kv
    and decoder sections and the generation options.
    kv_requant: in hybrid mode with per-graph uint8 KV encodings (HTP bundles), convert prefill's rows to decode's
    encoding (False reuses them as they are: to measure what the conversion buys).
    lookahead: k > 0 drafts up to k tokens per greedy decode step by prompt lookup (runtime/decode/lookahead.py) and
    verifies them in one decoder call (CacheRow.verify); needs a symbolic-AR kind's logit_rows, or a rows_static
    bundle's verify session (verify_ar tokens: the drafts, padded). 0: off."""

    kv: KVSpec
    decoder: DecoderSpec
    eos_ids: list[int]
    io_dtype: str = "float32"
    kv_requant: bool = True
    lookahead: int = 0


class CacheRow:
    def __init__(self, sessions: DecoderSessions, config: DecoderConfig, embedding: TokenEmbedding,
                 cache_blocks: list[np.ndarray] | None = None, kind=None):
        """cache_blocks: this row's views of a batch's cache (KVCache.rows_of), None: a cache of its own. kind: the
        decoder kind (decoder_kinds.py; default: the config's)."""
        kv, dec = config.kv, config.decoder
        self.kind = kind = kind or decoder_kind(dec, kv)
        self.sessions, self.embedding = sessions, embedding
        self.kv_spec, self.dec = kv, dec
        self.dtype = np.dtype(config.io_dtype)
        self.kv_requant = config.kv_requant
        self.cache = KVCache(kv, kind.layout, rope_rows=dec.positions.rows, blocks=cache_blocks)
        self._steps: dict[tuple, object] = {}  # id(session), ctx, ar, rows -> the step for that shape
        self._buffers: dict[tuple, StepBuffers] = {}  # step.buffers_key -> buffers shared by the bound steps of one AR
        self.run_s = 0.0  # time inside graph calls (session.run), accumulated
        self.replays, self.replay_s = 0, 0.0  # lookahead calls run again over their kept rows (a recurrent state)
        self._argmax = None  # the last step's argmax per logits row (kind.argmax_output; StepBuffers.argmax_ids)
        self._token_step, self._token_ctx = None, -1  # decode_token's step and the cache prefix it reads
        # (mode, n, cache epoch): the cache's rows 0..n-1 are bit for bit those a fresh prefill of the same prompt in
        # that mode computes (see reusable)
        self._exact: tuple[str, int, int] = ("", 0, -1)
        # with a span input (decoder.span_input): the slots where the cache's prompt blocks began and where the last
        # ended (a span plan's blocks need not start at multiples of AR: runtime/decode/spans.py)
        self._bounds: list[int] = [0]

    def embed(self, ids) -> np.ndarray:
        """Token embeddings [n, hidden] of ids (TokenEmbedding.embed)."""
        return self.embedding.embed(ids)

    def _step_for(self, purpose: str, n: int, all_rows: bool = False):
        """The step object for n tokens of purpose ("prefill", "decode", "verify") at the cache's next slot;
        all_rows: it returns every row's logits (a lookahead verify step)."""
        kind = self.kind
        ar = kind.ar(purpose, n)  # a symbolic-AR graph takes exactly the step's tokens; a static one its AR, padded
        session = self.sessions[kind.graph(purpose)]
        ctx = kind.context(self.cache.length)
        rows_out = kind.logits_rows(ar, all_rows)
        key = (id(session), ctx, ar, rows_out)
        step = self._steps.get(key)
        if step is None:
            if ar not in (1, self.dec.prefill_ar) and not all_rows:
                # a prompt's short last block, of any length: a step made for it and dropped, rather than one kept
                # (with its buffers) per block length
                step = (make_step(session, kind, self.cache, ctx, ar, self.dtype, None, rows_out, self.sessions.head)
                        if kind.bound_for_short_blocks() else
                        PlainStep(session, kind, self.cache, ctx, ar, self.dtype, rows_out, self.sessions.head))
            else:
                step = self._steps[key] = make_step(session, kind, self.cache, ctx, ar, self.dtype, self._buffers,
                                                    rows_out, self.sessions.head)
        return step

    def _call(self, step, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None,
              spans: np.ndarray | None = None) -> np.ndarray:
        """step(embeds, positions, rows, spans) at the cache's next slots, its time and argmax kept; the cache is not
        written. rows: the decoder's row input (decoder.row_input) for these tokens, None: zeros; spans: their image
        spans (decoder.span_input), None: none."""
        logits = step(embeds, positions, self.cache.length, rows, spans)
        self.run_s += step.run_s
        self._argmax = step.buffers.argmax_ids
        return logits

    def _run(self, step, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None,
             spans: np.ndarray | None = None) -> np.ndarray:
        """_call, then the rows of all n tokens go into the cache; logits of at most n rows."""
        n = embeds.shape[0]
        logits = self._call(step, embeds, positions, rows, spans)
        self.kind.store(self.cache, step.staged, n, step.buffers.positions)
        return logits if n == len(logits) else logits[:n]

    def pick(self, sampler: Sampler, logits: np.ndarray, row: int = -1, argmax=None,
             constraint: Constraint | None = None) -> int:
        """sampler(logits[row]), logits [rows, vocab] being the last step's; a greedy pick reads the graph's argmax of
        the row where the graph returns one (kind.argmax_output: the same index, first of equal maxima, as
        np.argmax; no pass over cold logits on the host). argmax: the argmax ids of logits' rows (default: this cache
        row's last step's; a batched call's: StepBuffers.argmax_ids). constraint: the sequence's grammar, the choice
        made among the tokens it allows (the graph's argmax taken where allowed: runtime/decode/grammar.py)."""
        top = None
        if self.kind.argmax_output and sampler.cfg.temperature == 0:
            top = (self._argmax if argmax is None else argmax)[row]
            if constraint is None:
                return top
        if constraint is not None:
            return constraint.pick(sampler, logits[row], top)
        return sampler(logits[row])

    def positions(self, n: int) -> np.ndarray:
        """Rope positions [rows, n] of n rows after the cache's kept ones, each one past the previous (text)."""
        return np.broadcast_to(self.cache.next_position() + np.arange(n, dtype=np.int64), (self.dec.positions.rows, n))

    def step(self, purpose: str, embeds: np.ndarray, positions: np.ndarray | None = None,
             rows: np.ndarray | None = None, spans: np.ndarray | None = None) -> np.ndarray:
        """One graph call ("prefill" or "decode") over embeds [n, hidden] at positions [rows, n] (None: those after
        the cache's, CacheRow.positions), written to the cache's next slots; rows [n, width]: the decoder's row input
        (decoder.row_input; None: zeros); spans [n]: their image spans (decoder.span_input; None: none). Returns
        logits [n, vocab] ([1, vocab], the last token's, with logit_rows), possibly a view of a buffer that the next
        step of the same shape overwrites."""
        n = embeds.shape[0]
        positions = self.positions(n) if positions is None else np.asarray(positions, np.int64)
        if positions.shape != (self.dec.positions.rows, n):
            raise ValueError(f"positions must be [{self.dec.positions.rows}, {n}], not {list(positions.shape)}")
        self.kind.check_positions(positions, self.cache.length)
        return self._run(self._step_for(purpose, n), embeds, positions, rows, spans)

    def step_token(self, token: int) -> np.ndarray:
        """step("decode", embed([token]))[-1], the token's row written straight into the step's input buffer."""
        return self.decode_token(token)[-1]

    def decode_token(self, token: int) -> np.ndarray:
        """One decode step of one row (a graph of one sequence per call): logits [rows, vocab] (pick from the last)."""
        ctx = self.kind.context(self.cache.length)
        step = self._token_step
        if ctx != self._token_ctx:  # its binding holds while the cache prefix it reads does (gqa_in_place: always)
            step = self._token_step = self._step_for("decode", 1)
            self._token_ctx = ctx
        b = step.buffers
        self.embedding.into_step(token, b)
        b.set_position(self.cache.next_position())
        return self._run(step, b.first, None)  # a decode step's AR is 1

    def decoded(self, mode: str) -> None:
        """A decode step's row went into the cache (by decode_token or a batched call): in kv mode it is the row a
        fresh prefill computes (each prompt row is one AR=1 step at its slot), so the exact prefix grows with it."""
        m, n, epoch = self._exact
        if self.blocks(mode) == 1 and n == self.cache.length - 1:
            self._exact = (mode, self.cache.length, self.cache.epoch)

    def verify(self, token: int, drafts: list[int], sampler: Sampler, constraint: Constraint | None = None,
               rows: list | None = None) -> list[int]:
        """One decoder call over [token, *drafts] at the cache's next slots, every row's logits: the longest
        prefix of drafts that the sampler (greedy) picks row by row, then its own pick after them. Only the rows of
        token and the accepted drafts go into the cache (those a plain decode of the same tokens writes): the rows of
        rejected drafts (and a static verify graph's padding rows) are dropped, as a padded prefill block's are.
        constraint: the sequence's grammar (drafts it allows only): row i picks among the tokens it allows after the
        drafts before it, each accepted draft advancing it; it is rolled back after, as it was before the call (the
        sequence's emit advances it by the tokens returned). rows: a list that gets the logits row each returned token
        was picked from (unmasked; views until the next call)."""
        n = 1 + len(drafts)
        step = self._step_for("verify", n, all_rows=True)
        logits = self._call(step, self.embedding.embed([token, *drafts]), self.positions(n))  # [n, vocab] (static: [ar, vocab])
        out, advanced = [], 0  # (drafts the constraint took)
        try:
            for i in range(len(logits)):
                out.append(self.pick(sampler, logits, i, constraint=constraint))
                if rows is not None:
                    rows.append(logits[i])
                if i == len(drafts) or out[-1] != drafts[i]:
                    break
                if constraint is not None:
                    constraint.accept(drafts[i])
                    advanced += 1
        finally:
            if constraint is not None:
                constraint.rollback(advanced)
        if self.cache.keeps(len(out), n):
            self.kind.store(self.cache, step.staged, len(out), step.buffers.positions)
        else:  # a state that cannot keep this part of the call (a recurrent one; a windowed cache whose kept rows
            # the call evicted) still holds the state before it: the kept rows again
            if rows is not None:  # (the rows outlive the call that replays: copies)
                rows[:] = [r.copy() for r in rows]
            t = time.perf_counter()
            kept = len(out)
            self._run(self._step_for("verify", kept, all_rows=True), self.embedding.embed([token, *drafts[:kept - 1]]),
                      self.positions(kept))
            self.replays += 1
            self.replay_s += time.perf_counter() - t
        return out

    def blocks(self, mode: str) -> int:
        """Tokens per prompt step in mode: prefill_ar for hybrid (with a prefill graph), else 1."""
        return self.dec.prefill_ar if mode == "hybrid" and self.sessions.prefill is not None else 1

    def reusable(self, mode: str, common: int) -> int:
        """Where a prefill in mode may start keeping the cache's rows before it (prefill(..., start=)), given that
        the new prompt's first `common` rows are those the cache holds (same ids, images and positions): the largest
        start <= common from which the rows of a resumed prefill are bit for bit those of a fresh one. Rows count
        when a fresh prefill computes them the same way: in kv mode every row (each is one AR=1 step at its slot,
        generated tokens' too); in hybrid mode the full AR blocks of the last prompt (a block starting at a multiple
        of AR), never a short last block, generated tokens or rows re-encoded for decode (kv_requant)."""
        m, rows, epoch = self._exact
        if m != mode or epoch != self.cache.epoch:
            return 0
        n = min(common, rows, self.cache.length)
        if self._span_blocks(mode):  # (a span plan: the blocks' own starts, where every state can be had)
            return max(b for b in self._bounds if b <= n and self.cache.restorable(b) == b)
        return self.cache.restorable(n - n % self.blocks(mode), self.blocks(mode))

    def _span_blocks(self, mode: str) -> bool:
        """Whether prompt blocks in mode follow a span plan (a span input and blocks of more than one row)."""
        return bool(self.dec.span_input) and self.blocks(mode) > 1

    # --- a prompt, block by block (the scheduler runs one block per round) ---
    def begin(self, prompt_embeds: np.ndarray, mode: str, start: int = 0,
              positions: np.ndarray | None = None) -> np.ndarray:
        """Ready the rows for a prompt (prompt_embeds: its rows from slot start on; the rows 0..start-1 are kept, start
        from reusable()): checks what it is given (ValueError, ContextOverflow), then rewinds or resets the cache.
        Returns the prompt's rope positions [rows, n] (None given: one past the other from the kept rows')."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        n = prompt_embeds.shape[0]
        if n == 0:
            raise ValueError("empty prompt")
        if start + n >= self.kv_spec.max_context:
            raise ContextOverflow(
                f"prompt is {start + n} tokens but the bundle's max context is {self.kv_spec.max_context} "
                f"(room is needed for at least one new token); re-export with a larger --max-seq-len"
            )
        ar = self.blocks(mode)
        off_block = start not in self._bounds if self._span_blocks(mode) else start % ar
        if start and (off_block or start > self.reusable(mode, start)):
            raise ValueError(f"cannot resume a {mode} prefill at {start}: not a reusable prefix of the cache")
        positions_given = positions is not None
        if positions_given:
            positions = np.asarray(positions, np.int64)
            if positions.shape != (self.dec.positions.rows, n):
                raise ValueError(f"positions must be [{self.dec.positions.rows}, {n}], not {list(positions.shape)}")
        if start:
            self.cache.rewind(start)
        else:
            self.cache.reset()
        self._bounds = [b for b in self._bounds if b <= start] if start else [0]
        if not positions_given:
            positions = self.positions(n)
        reading = self.kv_spec.encodings.get("prefill" if ar > 1 else "decode")
        if reading:  # a uint8 cache: the slots the graph reads unwritten hold its zero (KVCache.clear_unused)
            self.cache.clear_unused(reading)
        return positions

    def block(self, mode: str, embeds: np.ndarray, positions: np.ndarray, rows: np.ndarray | None,
              spans: np.ndarray | None = None) -> np.ndarray:
        """One prompt block (prefill_ar rows in hybrid mode, one in kv mode; with spans, block_end's: a whole span)
        through its graph into the cache; at a block's end (a multiple of the mode's block; each block's under a span
        plan) a snapshot of the states that keep them (KVCache.checkpoint: a recurrent layer's, a windowed cache's,
        for a later prompt to keep this prefix)."""
        purpose = self._block_graph(mode, len(embeds))
        enc = self.kv_spec.encodings
        swap = purpose == "prefill" and self.blocks(mode) == 1 and enc.get("prefill") and enc.get("decode")
        if swap:  # (a span in kv mode on a uint8 cache of two encodings: the prefill graph reads its own)
            self.cache.requantize(enc["decode"], enc["prefill"])
        logits = self.step(purpose, embeds, positions, rows, spans)
        if swap:
            self.cache.requantize(enc["prefill"], enc["decode"])
        if self._bounds[-1] != self.cache.length:
            self._bounds.append(self.cache.length)
        if not self.cache.drops_rows and (self._span_blocks(mode) or self.cache.length % self.blocks(mode) == 0):
            self.cache.checkpoint()
        return logits

    def _block_graph(self, mode: str, n: int) -> str:
        """The graph a prompt block of n rows in mode calls: prefill's in hybrid mode; in kv mode decode's, unless
        the block is a span longer than the decode graph's AR (a static one's: 1), which only prefill's takes."""
        if self.blocks(mode) > 1 or (n > self.kind.ar("decode", n) and self.sessions.prefill is not None):
            return "prefill"
        return "decode"

    def end(self, mode: str, start: int, n: int) -> None:
        """After a prompt's last block (start + n rows kept): its rows in decode's encoding (kv_requant), and how many
        of them a later prompt may keep (reusable)."""
        ar, enc = self.blocks(mode), self.kv_spec.encodings
        exact = start + n - n % ar
        if self._span_blocks(mode):  # (the last block's start: a fresh prefill of a longer prompt may cut it longer)
            exact = self._bounds[-2] if len(self._bounds) > 1 else start
        if ar > 1 and self.kv_requant and enc.get("prefill") and enc.get("decode"):
            self.cache.requantize(enc["prefill"], enc["decode"])
            exact = 0  # the rows are in decode's encoding now, a prefill reads prefill's
        self._exact = (mode, exact, self.cache.epoch)

    def prefill(self, prompt_embeds: np.ndarray, mode: str, start: int = 0,
                positions: np.ndarray | None = None, rows: np.ndarray | None = None,
                spans: np.ndarray | None = None) -> np.ndarray:
        """Run the prompt through the decoder; returns the last token's logits. start > 0: prompt_embeds are the
        rows from slot start on and the cache's rows 0..start-1 are kept (start from reusable()). positions
        [rows, n] int64: the rope positions of prompt_embeds' rows (None: one past the other from the kept rows');
        runtime/prompt/positions.py computes a prompt's. rows [n, width]: the decoder's row input of prompt_embeds' rows
        (decoder.row_input: the image rows' vision features; None: zeros), fed block by block; spans [n]: their
        image spans (decoder.span_input; None: none), the blocks cut so that none splits a span (spans.block_end)."""
        positions = self.begin(prompt_embeds, mode, start, positions)
        n, ar, b = prompt_embeds.shape[0], self.blocks(mode), 0
        while b < n:
            e = block_end(spans, b, ar, n)
            logits = self.block(mode, prompt_embeds[b:e], positions[:, b:e], None if rows is None else rows[b:e],
                                None if spans is None else spans[b:e])
            b = e
        self.end(mode, start, n)
        return logits[-1]

    def score(self, prompt_embeds: np.ndarray, tokens: list[int], mode: str = "hybrid",
              positions: np.ndarray | None = None, rows: np.ndarray | None = None,
              spans: np.ndarray | None = None) -> np.ndarray:
        """Teacher forcing: logits [len(tokens), vocab], row i predicting tokens[i] after prompt + tokens[:i]."""
        out = [self.prefill(prompt_embeds, mode, positions=positions, rows=rows, spans=spans).copy()]  # copies: bound steps reuse their logits
        for t in tokens[:-1]:
            if self.cache.length >= self.kv_spec.max_context:
                break
            out.append(self.step_token(t).copy())
        return np.stack(out)
