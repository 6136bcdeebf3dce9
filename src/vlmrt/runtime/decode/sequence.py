"""A sequence: one request's generation state, plain data the scheduler (runtime/decode/scheduler.py) advances.

    seq = Sequence(embeds, mode="hybrid", max_new_tokens=64, sampler=Sampler(cfg), positions=None, rows=None,
                   start=0, prompt_ids=ids)
    scheduler.add(seq)               # onto a free cache row (its rows 0..start-1 kept: a prefix reuse)
    while not seq.done:
        scheduler.step()             # one round: a prompt block, or a decode (or lookahead verify) step
        ids = seq.take()             # the ids generated since the last take (EOS is not among them)
    seq.stats                        # GenerationStats; seq.stop_reason; seq.error (a call that failed it)

A sequence with a constraint (runtime/decode/grammar.py) picks only tokens its grammar allows; each emitted token
advances the grammar, and a grammar that allows nothing more ends the sequence (stop_reason "grammar").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .grammar import Constraint, GrammarError
from .logprobs import TokenLogprob
from .lookahead import PromptLookup
from .sampler import Sampler, SamplingConfig

if TYPE_CHECKING:
    from ..prompt.prompt_rows import PromptRows


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # prompt through the decoder up to the first token's logits
    decode_s: float = 0.0  # all later decoder steps
    stop_reason: str = ""  # "eos" | "length" | "context" | "grammar"
    step_times: list[float] = field(default_factory=list)
    decode_run_s: float = 0.0  # the part of decode_s spent inside the graph call (session.run)
    drafted_tokens: int = 0  # lookahead: drafts verified, and those the model agreed with (emitted without a call)
    accepted_tokens: int = 0
    # a state that is not per slot (a recurrent layer's: runtime/decode/recurrent_state.py): snapshots taken at the
    # prompt's block ends and their time (in prefill_s); lookahead calls run again over their kept rows and their time
    # (in decode_s)
    state_snapshots: int = 0
    snapshot_s: float = 0.0
    state_replays: int = 0
    replay_s: float = 0.0

    @property
    def host_overhead_ms_per_step(self) -> float:
        """Decode time per step outside the graph call: embedding lookup, feeds, KV write, sampling, the round."""
        steps = len(self.step_times)
        return 1000 * (self.decode_s - self.decode_run_s) / steps if steps else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.generated_tokens - 1  # the first token comes from prefill
        return steps / self.decode_s if self.decode_s and steps > 0 else 0.0


@dataclass(eq=False)
class Sequence:
    """One request's state. Given: prompt embeddings [n, hidden] (from slot start on; an array, or the runtime's
    PromptRows, which makes each block's rows when it runs), mode, max_new_tokens,
    sampler, ignore_eos, positions [rope rows, n] (None: one past the other), rows [n, width] (the decoder's row input,
    None: zeros), prompt_ids (the whole prompt's ids from slot 0: lookahead drafts from them), constraint (the grammar
    its tokens are held to, None: free), logprobs (None, or the number of top tokens to record beside each emitted
    token's log probability: runtime/decode/logprobs.py), spans [n] (the rows' image spans, decoder.span_input: no
    prompt block splits one; None: none). The scheduler sets the rest: its row (the cache row it runs
    on), the prompt blocks still to run (next_block: where the next begins), the token to feed next, the lookahead
    drafter, the ids emitted (and not yet taken; their token_logprobs) and its stop state."""

    embeds: np.ndarray | PromptRows
    mode: str = "hybrid"
    max_new_tokens: int = 256
    sampler: Sampler = field(default_factory=lambda: Sampler(SamplingConfig()))
    ignore_eos: bool = False
    start: int = 0
    prompt_ids: list[int] | None = None
    positions: np.ndarray | None = None
    rows: np.ndarray | None = None
    constraint: Constraint | None = None
    logprobs: int | None = None  # record each emitted token's log probability and this many top ones (None: off)
    spans: np.ndarray | None = None  # [n] int64: the prompt rows' image spans (decoder.span_input; None: none)
    # --- the scheduler's ---
    row: int = -1  # the cache row (-1: not admitted)
    next_block: int = 0  # the next prompt row to run (== len(embeds): the prompt is in the cache)
    token: int = -1  # the last emitted token: the next decode step's input
    drafter: PromptLookup | None = None
    ids: list[int] = field(default_factory=list)  # every id emitted
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # with logprobs: one per id, in order
    taken: int = 0  # ids[:taken] were handed out by take()
    stop_reason: str = ""  # eos | length | context | grammar (its grammar complete) | cancelled (removed before it
    # ended) | error
    error: BaseException | None = None  # what failed it (a decoder call that raised)
    stats: GenerationStats = field(default_factory=GenerationStats)
    began: float = 0.0  # perf_counter when admitted (prefill_s runs from here to the first token)

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def prefilling(self) -> bool:
        return self.next_block < len(self.embeds)

    def take(self) -> list[int]:
        """The ids emitted since the last take."""
        out = self.ids[self.taken :]
        self.taken = len(self.ids)
        return out

    def emit(self, tokens: list[int], eos: set[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """The picked tokens in order, until one stops the sequence (an EOS, not emitted; its grammar complete; the
        length); logprobs: each token's (with self.logprobs), kept beside the ids emitted."""
        st, c = self.stats, self.constraint
        for i, token in enumerate(tokens):
            if token in eos and not self.ignore_eos:
                self.stop("eos")
                return
            st.generated_tokens += 1
            self.ids.append(token)
            if logprobs:
                self.token_logprobs.append(logprobs[i])
            self.token = token
            if c is not None:
                if not c.accept(token):
                    self.stop("error", GrammarError(f"token {token} is not allowed by the grammar"))
                    return
                if c.finished:
                    self.stop("grammar")
                    return
            if st.generated_tokens >= self.max_new_tokens:
                self.stop("length")
                return
            if self.drafter:
                self.drafter.append(token)

    def stop(self, reason: str, error: BaseException | None = None) -> None:
        if not self.stop_reason:
            self.stop_reason = self.stats.stop_reason = reason
            self.error = error
