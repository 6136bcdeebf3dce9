"""The worker of `vlmrt batch`: loads the bundle once, then answers batches of requests.

    w = Answerer(bundle, options={"max_new_tokens": 32})
    w({"request": ['{"id": 1, "messages": [...]}', ...]})   # -> {"key": [...], "line": [...], "error": [...]}

Ray Data runs it as the class of `map_batches` (one instance per actor); `--workers 1` without Ray calls it in
the driver's process. Every request goes through VLM.chat (images by path, URL or data URI, several, or whole
conversations): an answer is the one `vlmrt run` gives for the same request. A request that fails (a missing image,
an unreachable URL, a prompt longer than the context) becomes its error line; the batch goes on.
Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os

from ..runtime.pipeline import VLM
from ..runtime.sources import FetchLimits
from ..runtime.url_policy import AddressPolicy


def error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (ValueError, OSError, KeyError)):  # vlmrt's own errors: their message says it all
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def answer(vlm: VLM, request: dict, options: dict) -> dict:
    """One output line (as a dict) for one request {"id", "messages"}."""
    try:
        for _ in vlm.chat(request["messages"], **options):
            pass
    except Exception as e:  # one record's failure is its error line, never the job's
        return {"id": request["id"], "error": error_text(e)}
    return {"id": request["id"], **vlm.result.to_dict()}


class Answerer:
    """One worker: the bundle loaded once (VLM.load), generation options fixed at construction."""

    def __init__(self, bundle: str, device: str = "cpu", threads: int | None = None, verify: bool = True,
                 kv_requant: bool = True, options: dict | None = None, lookahead: int = 0,
                 fetch: FetchLimits = FetchLimits(addresses=AddressPolicy())):
        """fetch: how records' image URLs are fetched (default: public addresses only, as runner.fetch_limits)."""
        self.vlm = VLM.load(bundle, device=device, threads=threads, verify=verify, kv_requant=kv_requant,
                            lookahead=lookahead, fetch=fetch)
        self.options = dict(options or {})
        self.pid = os.getpid()

    def __call__(self, batch: dict) -> dict:
        """{"request": [JSON text of {"id", "messages"}, ...]} -> {"key": [id key, ...], "line": [JSON text, ...],
        "error": [the line is an error line, ...]}"""
        from .records import id_key

        keys, lines, errors = [], [], []
        for text in batch["request"]:
            request = json.loads(str(text))
            res = answer(self.vlm, request, self.options)
            keys.append(id_key(request["id"]))
            lines.append(json.dumps(res, ensure_ascii=False))
            errors.append("error" in res)
        return {"key": keys, "line": lines, "error": errors}
