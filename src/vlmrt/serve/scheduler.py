"""N slots over one bundle, run by one thread: each slot is a VLM of its own (its own KV cache rows, prefix cache and
image cache) over the bundle's shared ORT sessions, so requests never see each other's state.

    sched = Scheduler(bundle, slots=4, max_queue=16)
    job = Job(messages, key, options, asyncio.get_running_loop())
    sched.submit(job)            # QueueFull when max_queue jobs already wait for a slot
    kind, value = await job.events.get()   # ("piece", text) ... then ("done", Finished) | ("error", APIError)
                                           # (with logprobs: ("logprobs", [entry, ...]) before each piece's text)
    sched.cancel(job)            # | ("cancelled", None): a client that went away; its slot is free again

The slots' VLMs run through one AnswerLoop over one scheduler (runtime/answers.py, runtime/decode/scheduler.py), the loop
that `vlmrt batch` and VLM.chat run too: the thread runs rounds: each new request's images are encoded one vision call
per round, its prompt runs one prefill block per round, and one decoder call advances every slot that decodes (where
the graph takes a batch: decoder.kind.batched; else one call per slot: the NPU target's static graphs). A request that
fails (a bad image, a context overflow, a bug in its own steps) fails alone; a batched call that raises fails the
requests it was to advance, each with a 500 JSON error (their state is not retried: the call may have written part of
their rows). Where the probe at load found one-row calls computing a row apart from multi-row ones
(Scheduler.probe), every batched call runs at least two rows, so an answer does not depend on how many others decode
beside it. A waiting request goes to the free slot whose last conversation it continues (the most leading messages shared,
more than the system messages: a follow-up question finds its KV rows), else to a free slot that holds no
conversation (the lowest), else to the least recently used one: a new conversation that shares only the system
message with a conversation between its turns does not take that conversation's slot. Correctness does not depend on that choice: the slot's prefix cache keeps only rows whose
keys match.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from ..runtime.answers import AnswerLoop
from ..runtime.decode.cache_row import ContextOverflow
from ..runtime.decode.grammar import GrammarError
from ..runtime.prompt.conversation import ConversationError, video_refusal
from ..runtime.media.image import ImageError
from ..runtime.vlm import VLM
from ..runtime.decode.prefix_cache import common_prefix
from .errors import APIError, bad_request, context_exceeded, internal

log = logging.getLogger("vlmrt.serve")

SYSTEM_ROLES = ("system", "developer")  # leading messages many conversations share (a deployment's system prompt)


class QueueFull(Exception):
    pass


@dataclass
class Finished:
    text: str
    prompt_tokens: int
    completion_tokens: int
    stop_reason: str  # RunStats.stop_reason: eos | length | context | stop
    stats: dict  # RunStats as a dict
    queue_s: float
    slot: int
    logprobs: list[dict] | None = None  # asked for: each answer token's (TokenLogprob.as_dict: OpenAI's shape)
    # the time before each token after the first: from the end of the round that brought the token before it to the
    # end of the round that brought it (0 for a token that came in the same round as the one before: lookahead)
    token_gaps: list[float] = field(default_factory=list)


class Job:
    def __init__(self, messages: list[dict], key: list, options: dict, loop: asyncio.AbstractEventLoop):
        self.messages, self.key, self.options, self.loop = messages, key, options, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.queue_s = 0.0
        self.slot = -1
        self.sent_logprobs = 0  # the answer's token logprobs sent as events so far

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is gone
            pass


class Slot:
    def __init__(self, index: int, vlm: VLM):
        self.index, self.vlm = index, vlm
        self.job: Job | None = None
        self.begun = False  # its job's answer is in the loop
        self.history: list = []  # the key of its last conversation, answer included
        self.used = 0.0
        # its answer's tokens as the rounds bring them: the Result counted, its tokens so far, when the last came,
        # the gaps between them (Finished.token_gaps)
        self.counted: object = None
        self.tokens, self.last_t, self.gaps = 0, 0.0, []


class Scheduler:
    def __init__(self, bundle, slots: int, max_queue: int, load_s: float = 0.0, pad: bool = True, **vlm_options):
        """pad: the batch's calls as wide as its probe says (False: as wide as their rows, `--no-batch-padding`).
        vlm_options: VLM keyword arguments (kv_requant, image_cache_bytes per slot, fetch)."""
        if slots < 1 or max_queue < 0:
            raise ValueError("--slots must be >= 1 and --queue >= 0")
        self.max_context = bundle.manifest.kv.max_context
        self.no_video = video_refusal(bundle.manifest.prompt)  # why the bundle takes no videos (None: it does)
        vlms = VLM.slots(bundle, slots, load_s, **vlm_options)
        self.loop = AnswerLoop(vlms)
        self.decoder = sched = self.loop.scheduler
        p = sched.probed
        if p is not None:
            log.info("batched decoding over %d slots: one-row calls %s multi-row ones (max |logit diff| %.3g)%s", slots,
                     "compute a row as" if not p["one_row_diff"] else "round apart from", p["one_row_diff"],
                     "; a call runs at least %d rows" % p["min_rows"] if p["min_rows"] > 1 else "")
            if not pad and sched.min_rows > 1:
                sched.min_rows = 1
                log.warning("batched decoding: --no-batch-padding: a request alone runs one-row calls, so its answer "
                            "can depend on the load")
            if not p["invariant"]:
                log.warning("batched decoding: a row's logits depend on the other rows' (max |diff| %.3g): answers "
                            "may depend on the load", p["neighbour_diff"])
        self.slots = [Slot(i, v) for i, v in enumerate(vlms)]
        self.max_queue = max_queue
        self.waiting: deque[Job] = deque()
        self.counts: Counter = Counter()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="vlmrt-scheduler", daemon=True)
        self._thread.start()

    # --- the event loop's side ----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop or len(self.waiting) >= self.max_queue + sum(s.job is None for s in self.slots):
                self.counts["refused"] += 1
                raise QueueFull()
            self.waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        job._cancel.set()
        with self._cv:
            self._cv.notify()

    def status(self) -> dict:
        with self._cv:
            busy = sum(s.job is not None for s in self.slots)
            kv = sum(s.vlm.row.cache.nbytes for s in self.slots)
            rows_used = sum(s.vlm.row.cache.length for s in self.slots)
            images = sum(s.vlm.image_cache.bytes for s in self.slots)
            d = self.decoder
            batch = {} if d.probed is None else {
                "batch_calls": d.calls, "batch_rows": d.rows_decoded, "batch_widest": d.widest,
                "batch_min_rows": d.min_rows,
                # answers independent of the load: as the probe found, and padded as it said
                "batch_invariant": d.probed["invariant"] and d.min_rows >= d.probed["min_rows"]}
            return {"slots": len(self.slots), "busy": busy, "queued": len(self.waiting), "kv_cache_bytes": kv,
                    "kv_cache_rows": len(self.slots) * self.max_context, "kv_cache_rows_used": rows_used,
                    "image_cache_bytes": images, "batched": d.probed is not None, **batch, **self.counts}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            for job in [s.job for s in self.slots if s.job] + list(self.waiting):
                job._cancel.set()
            self._cv.notify()
        self._thread.join(timeout=30)

    def compile(self, options: dict) -> None:
        """The grammar a job with these options is held to, compiled ahead (VLM.answer_grammar: the tokenizer's
        first build and the compile off the model thread, which then finds it cached); GrammarError for one that
        cannot be. Called from a worker thread."""
        self.slots[0].vlm.answer_grammar(options.get("tools"), options.get("tool_choice"),
                                         options.get("parallel_tool_calls", True), options.get("response_format"))

    # --- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._assign()
                active = [s for s in self.slots if s.job is not None]
                if not active:
                    if self._stop:
                        return
                    self._cv.wait()
                    continue
            for s in active:
                self._begin(s)
            try:
                events = self.loop.round()
            except Exception:  # (a bug outside any one answer: every answer in the round fails)
                log.exception("scheduler round failed")
                events = [(s.index, "error", None) for s in self.slots if s.job is not None and s.begun]
                for i, _, _ in events:
                    self.loop.cancel(i)
            now = time.perf_counter()
            for s in active:
                self._count_tokens(s, now)
            for i, kind, value in events:
                self._event(self.slots[i], kind, value)

    def _assign(self) -> None:
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            self.counts["cancelled"] += 1
            job.emit("cancelled")
        while self.waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self.waiting.popleft()
            # the slot of the conversation this request continues (it shares more than the leading system messages:
            # a follow-up finds its rows), else a slot that holds no conversation (the lowest), else the least
            # recently used (the most leading messages shared among equals). Sharing only a system message does not
            # make a conversation's slot the new one's: it would evict a conversation between its turns (its
            # follow-up prefilled cold) to save the system message's rows
            lead = next((i for i, (role, _) in enumerate(job.key) if role not in SYSTEM_ROLES), len(job.key))
            shared = {s.index: common_prefix(s.history, job.key) for s in free}
            s = max(free, key=lambda s: (shared[s.index] if shared[s.index] > lead else 0, not s.history, -s.used,
                                         shared[s.index], -s.index))
            job.queue_s, job.slot = time.perf_counter() - job.submitted, s.index
            s.job, s.begun, s.history = job, False, []

    def _free(self, s: Slot, history: list, outcome: str) -> None:
        with self._cv:
            s.job, s.begun, s.history, s.used = None, False, history, time.perf_counter()
            self.counts[outcome] += 1

    def _begin(self, s: Slot) -> None:
        """A cancelled job leaves its slot; a new one's answer is prepared (bad input: its error) and begun."""
        job = s.job
        if job.cancelled:
            self.loop.cancel(s.index)  # its sequence leaves the row; the prefix cache records what the rows hold
            self._free(s, [], "cancelled")
            job.emit("cancelled")
            return
        if s.begun:
            return
        try:
            self.loop.begin(s.vlm.chat_answer(job.messages, **job.options))
            s.begun = True
        except Exception as e:
            self._event(s, "error", e)

    @staticmethod
    def _count_tokens(s: Slot, now: float) -> None:
        """After a round: the gap before each token it brought to the slot's answer (Finished.token_gaps)."""
        res = s.vlm.result
        if s.job is None or not s.begun:
            return
        if res is not s.counted:  # a new answer on the slot
            s.counted, s.tokens, s.gaps = res, 0, []
        n = len(res.token_ids)
        if n > s.tokens:
            s.gaps += ([now - s.last_t] if s.tokens else []) + [0.0] * (n - s.tokens - 1)
            s.tokens, s.last_t = n, now

    @staticmethod
    def _logprobs(job: Job, res) -> None:
        """The answer's token logprobs not sent yet (those of the tokens streamed since), as one ("logprobs", ...)
        event: before the piece their text is in (a piece holds the text of the tokens before it, less what stop
        strings and incomplete characters hold back), or before "done" (tokens whose text never came as a piece)."""
        entries = res.logprobs
        if entries is None or len(entries) <= job.sent_logprobs:
            return
        job.emit("logprobs", [e.as_dict() for e in entries[job.sent_logprobs:]])
        job.sent_logprobs = len(entries)

    def _event(self, s: Slot, kind: str, value) -> None:
        job = s.job
        if job is None:
            return
        if kind == "piece":
            self._logprobs(job, s.vlm.result)
            job.emit("piece", value)
        elif kind == "done":
            st = value.stats
            self._logprobs(job, value)
            entries = None if value.logprobs is None else [e.as_dict() for e in value.logprobs]
            done = Finished(value.text, st.prompt_tokens, st.generated_tokens, st.stop_reason, asdict(st),
                            job.queue_s, s.index, entries, s.gaps[: max(0, st.generated_tokens - 1)])
            # the slot is free and holds the conversation BEFORE the client can have the answer: a follow-up sent the
            # instant it arrives (under load, while this thread is descheduled) finds its rows, not a busy slot
            self._free(s, job.key + [("assistant", (("text", value.text),))], "completed")
            job.emit("done", done)
        elif isinstance(value, ContextOverflow):
            job.emit("error", context_exceeded(s.vlm.result.stats.prompt_tokens, self.max_context, str(value)))
            self._free(s, [], "refused")
        elif isinstance(value, GrammarError):  # a response format or tool the engine cannot take: names the field
            job.emit("error", APIError(400, str(value), "invalid_request_error", "invalid_parameter", param=value.param))
            self._free(s, [], "refused")
        elif isinstance(value, (ConversationError, ImageError, ValueError)):
            job.emit("error", bad_request(str(value)))
            self._free(s, [], "refused")
        else:
            if value is not None:
                log.error("generation failed (slot %d)", s.index, exc_info=value)
            job.emit("error", internal())
            self._free(s, [], "failed")
