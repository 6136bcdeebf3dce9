"""The worker of `vlmrt batch`: loads the bundle once, then answers batches of requests.

    w = Answerer(bundle, options={"max_new_tokens": 32})
    w({"request": ['{"id": 1, "messages": [...]}', ...]})   # -> {"key": [...], "line": [...], "error": [...]}

Ray Data runs it as the class of `map_batches` (one instance per actor); `--workers 1` without Ray calls it in
the driver's process. Every request is a chat answer (VLM.chat_answer, run with the others by the AnswerLoop that runs
the server's slots: images by path, URL or data URI, several, or whole conversations): an answer is the one `vlmrt run` gives for the same request. A request that fails (a missing image,
an unreachable URL, a prompt longer than the context) becomes its error line; the batch goes on.
A worker answers up to `sequences` requests together (`--batch-size`): one VLM each over the bundle's sessions,
decoding together through one decoder call per round where the graph takes a batch, run by the loop that runs
`vlmrt serve`'s slots (runtime/answers.py AnswerLoop over runtime/decode/scheduler.py); a new request takes the place of one
that is done. A batched call that raises makes each request it was to advance an error line.
Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Iterable, Iterator

from ..runtime.answers import AnswerLoop
from ..runtime.bundle import Bundle
from ..runtime.vlm import VLM
from ..runtime.decode.scheduler import BatchCallFailed
from ..runtime.media.sources import FetchLimits
from ..runtime.media.url_policy import AddressPolicy


def error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, BatchCallFailed):
        return f"{msg}: {error_text(e.__cause__)}"
    if isinstance(e, (ValueError, OSError, KeyError)):  # vlmrt's own errors: their message says it all
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _with_json(line: dict) -> dict:
    """An answer held to a JSON schema and complete (stop reason grammar) also as its value, "json"."""
    if line["stats"]["stop_reason"] == "grammar":
        try:
            line["json"] = json.loads(line["text"])
        except ValueError:  # (a Lark grammar or a regex: text)
            pass
    return line


class Answerer:
    """One worker: the bundle loaded once (Bundle.open), `sequences` VLMs over it, generation options fixed at
    construction."""

    def __init__(self, bundle: str, device: str = "cpu", threads: int | None = None, verify: bool = True,
                 kv_requant: bool = True, options: dict | None = None, lookahead: int = 0,
                 fetch: FetchLimits = FetchLimits(addresses=AddressPolicy()), sequences: int = 1):
        """fetch: how records' image URLs are fetched (default: public addresses only, as runner.fetch_limits).
        sequences: requests answered together (>= 1)."""
        if sequences < 1:
            raise ValueError("--batch-size must be >= 1")
        t = time.perf_counter()
        b = Bundle.open(bundle, device=device, threads=threads, verify=verify)
        self.vlms = VLM.slots(b, sequences, time.perf_counter() - t, kv_requant=kv_requant, lookahead=lookahead,
                              fetch=fetch)
        self.loop = AnswerLoop(self.vlms)
        self.scheduler = self.loop.scheduler
        self.options = dict(options or {})
        self.pid = os.getpid()

    def answers(self, requests: Iterable[dict]) -> Iterator[dict]:
        """Each request's output line (as a dict), in the order they finish; up to len(self.vlms) at a time."""
        todo, running = deque(requests), {}  # VLM index -> its request
        while todo or running:
            for i, v in enumerate(self.vlms):
                while i not in running and todo:
                    r = todo.popleft()
                    try:
                        opts = self.options if "response_format" not in r else {
                            **self.options, "response_format": r["response_format"]}  # the record's own
                        self.loop.begin(v.chat_answer(r["messages"], **opts))
                        running[i] = r
                    except Exception as e:  # one record's failure is its error line, never the job's
                        yield {"id": r["id"], "error": error_text(e)}
            for i, kind, value in self.loop.round():
                if kind == "piece":
                    continue
                r = running.pop(i)
                yield {"id": r["id"], **_with_json(value.to_dict())} if kind == "done" else {
                    "id": r["id"], "error": error_text(value)}

    def __call__(self, batch: dict) -> dict:
        """{"request": [JSON text of {"id", "messages"}, ...]} -> {"key": [id key, ...], "line": [JSON text, ...],
        "error": [the line is an error line, ...]}"""
        from .records import id_key

        keys, lines, errors = [], [], []
        for res in self.answers(json.loads(str(text)) for text in batch["request"]):
            keys.append(id_key(res["id"]))
            lines.append(json.dumps(res, ensure_ascii=False))
            errors.append("error" in res)
        return {"key": keys, "line": lines, "error": errors}
