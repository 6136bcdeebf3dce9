"""The generation engine: prompt embeddings in, token ids out. It knows nothing about text.

    engine = Engine(DecoderSessions(decode, prefill), EngineConfig(manifest.kv, manifest.decoder, eos_ids), embed_table)
    for token_id in engine.generate(prompt_embeds, mode="hybrid", max_new_tokens=64, sampler=Sampler(...),
                                    positions=None):   # [rope rows, n] int64; None: one past the other
        ...
    engine.last  # GenerationStats of the finished call

Sessions only need `run(output_names, feeds) -> list[np.ndarray]` (onnxruntime.InferenceSession
or a fake one in tests).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from ..format.manifest import DecoderSpec, KVSpec
from .decoder_kinds import decoder_kind
from .kv_cache import KVCache
from .lookahead import PromptLookup
from .sampler import Sampler, SamplingConfig
from .step import PlainStep, StepBuffers, make_step

MODES = ("kv", "hybrid")


class _Step:
    """STEP, what Engine.generate yields (and VLM.chat passes on) under a batch (Engine.batch): the sequence has
    handed its decode step to the batch (or run one prefill block) and waits for the batch's next call
    (runtime/batch_engine.py: BatchDecoder.run). Never yielded without a batch."""

    def __repr__(self) -> str:
        return "STEP"


STEP = _Step()


class Session(Protocol):
    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...


class ContextOverflow(ValueError):
    pass


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # prompt through the decoder up to the first token's logits
    decode_s: float = 0.0  # all later decoder steps
    stop_reason: str = ""  # "eos" | "length" | "context"
    step_times: list[float] = field(default_factory=list)
    decode_run_s: float = 0.0  # the part of decode_s spent inside the graph call (session.run)
    drafted_tokens: int = 0  # lookahead: drafts verified, and those the model agreed with (emitted without a call)
    accepted_tokens: int = 0

    @property
    def host_overhead_ms_per_step(self) -> float:
        """Decode time per step outside the graph call: embedding lookup, feeds, KV write, sampling."""
        steps = len(self.step_times)
        return 1000 * (self.decode_s - self.decode_run_s) / steps if steps else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes from prefill
        return steps / self.decode_s if self.decode_s and steps > 0 else 0.0


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
class EngineConfig:
    """What an Engine is built from, besides its sessions and embedding table: the manifest's kv and decoder sections
    and the generation options.
    kv_requant: in hybrid mode with per-graph uint8 KV encodings (HTP bundles), convert prefill's rows to decode's
    encoding (False reuses them as they are: to measure what the conversion buys).
    lookahead: k > 0 drafts up to k tokens per greedy decode step by prompt lookup (runtime/lookahead.py) and
    verifies them in one decoder call (verify); needs a symbolic-AR kind's logit_rows, or a rows_static bundle's
    verify session (verify_ar tokens: the drafts, padded). 0: off."""

    kv: KVSpec
    decoder: DecoderSpec
    eos_ids: list[int]
    io_dtype: str = "float32"
    kv_requant: bool = True
    lookahead: int = 0


class Engine:
    def __init__(self, sessions: DecoderSessions, config: EngineConfig, embed_table,
                 embed_scale: np.ndarray | None = None, cache_blocks: list[np.ndarray] | None = None):
        """embed_table: [vocab, hidden] rows by token id (an ndarray, or the bundle's EmbeddingRows: pread);
        embed_scale: [vocab] when the table is int8 rows. cache_blocks: this sequence's rows of a batch's cache
        (KVCache.rows_of; runtime/batch_engine.py), None: a cache of its own."""
        kv, dec = config.kv, config.decoder
        self.kind = kind = decoder_kind(dec, kv)
        kind.check_lookahead(config.lookahead)
        if config.lookahead and kind.verify_ar and sessions.verify is None:
            raise ValueError("lookahead on static graphs needs the bundle's verify graph session")
        if bool(kind.hidden_output) != (sessions.head is not None):
            raise ValueError("decoder.kind.hidden_output and a head graph session go together")
        self.lookahead = config.lookahead
        self.sessions = sessions
        self.kv_spec, self.dec = kv, dec
        # a memmap is indexed as a plain ndarray over the same mapping (np.memmap's __getitem__ is slow)
        self.embed_table = embed_table.view(np.ndarray) if isinstance(embed_table, np.memmap) else embed_table
        self.embed_scale = embed_scale
        # one row [hidden] by token id: EmbeddingRows.row (a reused buffer), or a view of the ndarray's row
        self._row = getattr(self.embed_table, "row", self.embed_table.__getitem__)
        self._vocab = self.embed_table.shape[0]
        # int8 tables under a graph that scales the row itself (kind.token_rows_input): a decode step reads
        # the token's row into the graph's input (EmbeddingRows.read_into), no multiply on the host
        self._read_row = self._scales = None
        if kind.token_rows_input and embed_scale is not None and self.embed_table.dtype == np.int8:
            self._read_row = getattr(self.embed_table, "read_into", None) or _ndarray_reader(self.embed_table)
            self._scales = array("f", np.asarray(embed_scale, np.float32).tobytes())  # [vocab], indexed as floats
        self.eos = set(config.eos_ids)
        self.dtype = np.dtype(config.io_dtype)
        self.cache = KVCache(kv, kind.layout, rope_rows=dec.positions.rows, blocks=cache_blocks)
        # a BatchDecoder (runtime/batch_engine.py): generate hands its decode steps to it and yields STEP, and
        # prefills one block per STEP; None: generate runs its steps itself
        self.batch = None
        self.kv_requant = config.kv_requant
        self.last = GenerationStats()
        self._steps: dict[tuple, object] = {}  # id(session), ctx, ar, rows -> the step for that shape
        self._buffers: dict[tuple, StepBuffers] = {}  # step.buffers_key -> buffers shared by the bound steps of one AR
        self.run_s = 0.0  # time inside graph calls (session.run), accumulated
        self._argmax = None  # the last step's argmax per logits row (kind.argmax_output; StepBuffers.argmax_ids)
        self._token_step, self._token_ctx = None, -1  # step_token's step and the cache prefix it reads
        # (mode, n, cache epoch): the cache's rows 0..n-1 are bit for bit those a fresh prefill of the same prompt in
        # that mode computes (see reusable)
        self._exact: tuple[str, int, int] = ("", 0, -1)

    def embed(self, ids: list[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        rows = self.embed_table[ids]
        if self.embed_scale is not None:
            return (rows.astype(np.float32) * self.embed_scale[ids][:, None]).astype(self.dtype)
        return np.asarray(rows, dtype=self.dtype)

    def embed_into(self, token: int, out: np.ndarray) -> None:
        """out [hidden] = token's embedding (as embed([token])[0], without its allocations: the decode loop's)."""
        if not 0 <= token < self._vocab:
            raise IndexError(f"token id {token} out of range 0..{self._vocab - 1}")
        row = self._row(token)
        if self.embed_scale is None:
            out[...] = row
        elif out.dtype == np.float32:
            np.multiply(row, self.embed_scale[token], out=out, dtype=np.float32)
        else:
            out[...] = row.astype(np.float32) * self.embed_scale[token]

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

    def _call(self, step, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None) -> np.ndarray:
        """step(embeds, positions, rows) at the cache's next slots, its time and argmax kept; the cache is not
        written. rows: the decoder's row input (decoder.row_input) for these tokens, None: zeros."""
        logits = step(embeds, positions, self.cache.length, rows)
        self.run_s += step.run_s
        self._argmax = step.buffers.argmax_ids
        return logits

    def _run(self, step, embeds: np.ndarray, positions: np.ndarray | None, rows: np.ndarray | None = None) -> np.ndarray:
        """_call, then the rows of all n tokens go into the cache; logits of at most n rows."""
        n = embeds.shape[0]
        logits = self._call(step, embeds, positions, rows)
        self.kind.store(self.cache, step.staged, n, step.buffers.positions)
        return logits if n == len(logits) else logits[:n]

    def _pick(self, sampler: Sampler, logits: np.ndarray, row: int = -1) -> int:
        """sampler(logits[row]), logits [rows, vocab] being the last step's; a greedy pick reads the graph's argmax of
        the row where the graph returns one (kind.argmax_output: the same index, first of equal maxima, as
        np.argmax; no pass over cold logits on the host)."""
        if self.kind.argmax_output and sampler.cfg.temperature == 0:
            return self._argmax[row]
        return sampler(logits[row])

    def positions(self, n: int) -> np.ndarray:
        """Rope positions [rows, n] of n rows after the cache's kept ones, each one past the previous (text)."""
        return np.broadcast_to(self.cache.next_position() + np.arange(n, dtype=np.int64), (self.dec.positions.rows, n))

    def step(self, purpose: str, embeds: np.ndarray, positions: np.ndarray | None = None,
             rows: np.ndarray | None = None) -> np.ndarray:
        """One graph call ("prefill" or "decode") over embeds [n, hidden] at positions [rows, n] (None: those after
        the cache's, Engine.positions), written to the cache's next slots; rows [n, width]: the decoder's row input
        (decoder.row_input; None: zeros). Returns logits [n, vocab] ([1, vocab], the
        last token's, with logit_rows), possibly a view of a buffer that the next step of the same shape overwrites."""
        n = embeds.shape[0]
        positions = self.positions(n) if positions is None else np.asarray(positions, np.int64)
        if positions.shape != (self.dec.positions.rows, n):
            raise ValueError(f"positions must be [{self.dec.positions.rows}, {n}], not {list(positions.shape)}")
        self.kind.check_positions(positions, self.cache.length)
        return self._run(self._step_for(purpose, n), embeds, positions, rows)

    def step_token(self, token: int) -> np.ndarray:
        """step("decode", embed([token]))[-1], the token's row written straight into the step's input buffer."""
        return self._decode_token(token)[-1]

    def _decode_token(self, token: int) -> np.ndarray:
        """step_token's logits [rows, vocab] (the decode loop picks from the last row)."""
        ctx = self.kind.context(self.cache.length)
        step = self._token_step
        if ctx != self._token_ctx:  # its binding holds while the cache prefix it reads does (gqa_in_place: always)
            step = self._token_step = self._step_for("decode", 1)
            self._token_ctx = ctx
        b = step.buffers
        if self._read_row is None:
            self.embed_into(token, b.first_row)
        elif 0 <= token < self._vocab:
            self._read_row(token, b.token_row(self._scales[token]))
        else:
            raise IndexError(f"token id {token} out of range 0..{self._vocab - 1}")
        b.set_position(self.cache.next_position())
        return self._run(step, b.first, None)  # a decode step's AR is 1

    def verify(self, token: int, drafts: list[int], sampler: Sampler) -> list[int]:
        """One decoder call over [token, *drafts] at the cache's next slots, every row's logits: the longest
        prefix of drafts that the sampler (greedy) picks row by row, then its own pick after them. Only the rows of
        token and the accepted drafts go into the cache (those a plain decode of the same tokens writes): the rows of
        rejected drafts (and a static verify graph's padding rows) are dropped, as a padded prefill block's are."""
        n = 1 + len(drafts)
        step = self._step_for("verify", n, all_rows=True)
        logits = self._call(step, self.embed([token, *drafts]), self.positions(n))  # [n, vocab] (static: [ar, vocab])
        out = []
        for i in range(len(logits)):
            out.append(self._pick(sampler, logits, i))
            if i == len(drafts) or out[-1] != drafts[i]:
                break
        self.kind.store(self.cache, step.staged, len(out), step.buffers.positions)
        return out

    def _blocks(self, mode: str) -> int:
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
        return n - n % self._blocks(mode)

    def prefill(self, prompt_embeds: np.ndarray, mode: str, start: int = 0,
                positions: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """Run the prompt through the decoder; returns the last token's logits. start > 0: prompt_embeds are the
        rows from slot start on and the cache's rows 0..start-1 are kept (start from reusable()). positions
        [rows, n] int64: the rope positions of prompt_embeds' rows (None: one past the other from the kept rows',
        Engine.positions); runtime/positions.py computes a prompt's. rows [n, width]: the decoder's row input of
        prompt_embeds' rows (decoder.row_input: the image rows' vision features; None: zeros), fed block by block."""
        steps = self.prefill_steps(prompt_embeds, mode, start, positions, rows)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, prompt_embeds: np.ndarray, mode: str, start: int = 0,
                      positions: np.ndarray | None = None, rows: np.ndarray | None = None):
        """prefill as a generator: yields STEP after each graph call but the last, returns the last token's logits
        (a batch interleaves a prompt's blocks with the other sequences' decode steps)."""
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
        ar = self._blocks(mode)
        if start:
            if start % ar or start > self.reusable(mode, start):
                raise ValueError(f"cannot resume a {mode} prefill at {start}: not a reusable prefix of the cache")
            self.cache.rewind(start)
        else:
            self.cache.reset()
        positions = self.positions(n) if positions is None else np.asarray(positions, np.int64)
        if positions.shape != (self.dec.positions.rows, n):
            raise ValueError(f"positions must be [{self.dec.positions.rows}, {n}], not {list(positions.shape)}")
        enc = self.kv_spec.encodings
        reading = enc.get("prefill" if ar > 1 else "decode")
        if reading:  # a uint8 cache: the slots the graph reads unwritten hold its zero (KVCache.clear_unused)
            self.cache.clear_unused(reading)
        exact = start + n - n % ar
        if ar > 1:
            for b in range(0, n, ar):
                if b:
                    yield STEP
                logits = self.step("prefill", prompt_embeds[b : b + ar], positions[:, b : b + ar],
                                   None if rows is None else rows[b : b + ar])
            if self.kv_requant and enc.get("prefill") and enc.get("decode"):
                self.cache.requantize(enc["prefill"], enc["decode"])
                exact = 0  # the rows are in decode's encoding now, a prefill reads prefill's
        else:
            for i in range(n):
                if i:
                    yield STEP
                logits = self.step("decode", prompt_embeds[i : i + 1], positions[:, i : i + 1],
                                   None if rows is None else rows[i : i + 1])
        self._exact = (mode, exact, self.cache.epoch)
        return logits[-1]

    def score(self, prompt_embeds: np.ndarray, tokens: list[int], mode: str = "hybrid",
              positions: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """Teacher forcing: logits [len(tokens), vocab], row i predicting tokens[i] after prompt + tokens[:i]."""
        out = [self.prefill(prompt_embeds, mode, positions=positions, rows=rows).copy()]  # copies: bound steps reuse their logits
        for t in tokens[:-1]:
            if self.cache.length >= self.kv_spec.max_context:
                break
            out.append(self.step_token(t).copy())
        return np.stack(out)

    def generate(self, prompt_embeds: np.ndarray, *, mode: str = "hybrid", max_new_tokens: int = 256,
                 sampler: Sampler | None = None, ignore_eos: bool = False, start: int = 0,
                 prompt_ids: list[int] | None = None, positions: np.ndarray | None = None,
                 rows: np.ndarray | None = None) -> Iterator[int]:
        """Yield generated token ids (EOS is not yielded). Stats land in self.last when done. start > 0: a prefix
        reuse, prompt_embeds are the rows from slot start on (see prefill). positions: their rope positions (see
        prefill); rows: their row input (see prefill). prompt_ids: the whole prompt's ids (from slot 0), where
        lookahead looks up drafts; lookahead runs with them and a greedy sampler only. Under a batch (self.batch) it
        also yields STEP: after each prefill block but the last, and after handing each decode step to the batch
        (runtime/batch_engine.py)."""
        sampler = sampler or Sampler(SamplingConfig())
        st = self.last = GenerationStats(prompt_tokens=int(prompt_embeds.shape[0]))
        if max_new_tokens <= 0:
            st.stop_reason = "length"
            return
        t0 = time.perf_counter()
        batch = self.batch
        if batch is None:
            logits = self.prefill(prompt_embeds, mode, start, positions, rows)
        else:
            logits = yield from self.prefill_steps(prompt_embeds, mode, start, positions, rows)
        one_by_one = self._blocks(mode) == 1  # a fresh kv prefill computes generated tokens' rows as decode does
        tokens = [self._pick(sampler, logits[None])]  # the next tokens to emit: one, or a lookahead step's accepted drafts and one
        st.prefill_s = time.perf_counter() - t0
        greedy = sampler.cfg.temperature == 0
        drafter = (PromptLookup(self.lookahead, prompt_ids, adapt=not self.kind.verify_ar)  # a static verify: fixed cost
                   if self.lookahead and greedy and prompt_ids else None)
        while True:
            for token in tokens:
                if token in self.eos and not ignore_eos:
                    st.stop_reason = "eos"
                    return
                st.generated_tokens += 1
                yield token
                if st.generated_tokens >= max_new_tokens:
                    st.stop_reason = "length"
                    return
                if drafter:
                    drafter.append(token)
            if self.cache.length >= self.kv_spec.max_context:
                st.stop_reason = "context"
                return
            t, run0 = time.perf_counter(), self.run_s
            drafts = None
            if drafter:  # drafts: no more than the answer and the cache have room for, none past an EOS
                room = min(max_new_tokens - st.generated_tokens, self.kv_spec.max_context - self.cache.length) - 1
                drafts = drafter.propose(room)
            if drafts and not ignore_eos:
                drafts = next((drafts[:i] for i, d in enumerate(drafts) if d in self.eos), drafts)
            if drafts:
                tokens = self.verify(token, drafts, sampler)
                drafter.feedback(len(tokens) - 1, len(drafts))
                st.drafted_tokens += len(drafts)
                st.accepted_tokens += len(tokens) - 1
            else:
                if batch is None:
                    logits = self._decode_token(token)
                else:  # the batch's next call advances this sequence with the others
                    batch.submit(self, token)
                    yield STEP
                    logits = batch.logits(self)
                if one_by_one and self._exact[1] == self.cache.length - 1:
                    self._exact = (mode, self.cache.length, self.cache.epoch)
                tokens = [self._pick(sampler, logits)]
            dt = time.perf_counter() - t
            st.decode_s += dt
            st.decode_run_s += self.run_s - run0
            st.step_times.append(dt)


def _ndarray_reader(table: np.ndarray):
    """EmbeddingRows.read_into for an int8 table held as an ndarray."""
    def read_into(token: int, buf) -> None:
        np.frombuffer(buf, np.int8)[...] = table[token]
    return read_into

