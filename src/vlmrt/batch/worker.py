"""The worker of `vlmrt batch`: loads the bundle once, then answers batches of requests.

    w = Answerer(bundle, options={"max_new_tokens": 32})
    w({"request": ['{"id": 1, "messages": [...]}', ...]})   # -> {"key": [...], "line": [...], "error": [...]}

Ray Data runs it as the class of `map_batches` (one instance per actor); `--workers 1` without Ray calls it in
the driver's process. Every request goes through VLM.chat (images by path, URL or data URI, several, or whole
conversations): an answer is the one `vlmrt run` gives for the same request. A request that fails (a missing image,
an unreachable URL, a prompt longer than the context) becomes its error line; the batch goes on.
A worker answers up to `sequences` requests together (`--batch-size`): one VLM each over the bundle's sessions,
decoding together through one decoder call per step where the graph takes a batch (runtime/batch_engine.py, as
`vlmrt serve`'s slots); a new request takes the place of one that is done. A batched call that raises makes each
request it was to advance an error line.
Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Iterable, Iterator

from ..runtime.batch_engine import batched_vlms
from ..runtime.bundle import Bundle
from ..runtime.engine import STEP
from ..runtime.sources import FetchLimits
from ..runtime.url_policy import AddressPolicy


def error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (ValueError, OSError, KeyError)):  # vlmrt's own errors: their message says it all
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


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
        self.vlms, self.batch = batched_vlms(b, sequences, time.perf_counter() - t, kv_requant=kv_requant,
                                             lookahead=lookahead, fetch=fetch)
        self.options = dict(options or {})
        self.pid = os.getpid()

    def answers(self, requests: Iterable[dict]) -> Iterator[dict]:
        """Each request's output line (as a dict), in the order they finish; up to len(self.vlms) at a time."""
        todo, running = deque(requests), {}  # VLM index -> (request, its chat)
        while todo or running:
            for i, v in enumerate(self.vlms):
                if i not in running and todo:
                    r = todo.popleft()
                    running[i] = (r, v.chat(r["messages"], **self.options))
            waiting = []
            for i, (r, gen) in list(running.items()):
                try:
                    if any(piece is STEP for piece in gen):  # (stops at STEP: it waits for the batch's call)
                        waiting.append(i)
                        continue
                    line = {"id": r["id"], **self.vlms[i].result.to_dict()}
                except Exception as e:  # one record's failure is its error line, never the job's
                    line = {"id": r["id"], "error": error_text(e)}
                del running[i]
                yield line
            if waiting:
                rows = set(self.batch.pending) if self.batch is not None else set()  # (VLM i: row i)
                try:
                    self.batch.run()
                except Exception as e:
                    for i in sorted(rows):
                        r, gen = running.pop(i)
                        gen.close()
                        yield {"id": r["id"], "error": f"batched decode step failed: {error_text(e)}"}

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
