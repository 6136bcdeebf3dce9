"""The Starlette app: POST /v1/chat/completions, POST /v1/responses (translated into a chat request:
responses_api.py), GET /v1/models, GET /health, GET /metrics (Prometheus: metrics.py), GET / (the chat page).

    app = create_app(load, model_id="easyvqa")   # load() -> Scheduler, run in a thread at startup
    uvicorn.run(app)                              # /health is 503 until load() returns, then 200

Around the routes, access.py's middleware: the Host check, CORS, the Origin check and API keys (Config says which).
A request is read (at most max_body bytes: else 413; all of it within body_timeout_s: else 408 and the connection is
closed), checked (400s), its images decoded in a worker thread (a request with http(s) URLs on the fetch threads,
the others on the default executor's, so that slow URLs cannot hold up data URIs; URLs within Config.fetch: public
addresses only unless --allow-local-urls), then queued (503 when full). The answer waits for the first event of
its generation, so that an error found there (the prompt does not fit the context) is still a plain JSON 400 for a
streamed request too. A watcher reads the connection while the request waits or generates: a client that goes
away cancels its job, which frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..runtime.decode.grammar import GrammarError
from ..runtime.media.sources import FetchLimits
from ..runtime.media.url_policy import AddressPolicy
from .access import ApiKeys, Cors, HeadSize, HostCheck, OriginCheck
from .errors import APIError, bad_request, internal, unavailable
from .limits import (BODY_TIMEOUT_S, FETCH_THREADS, HEAD_TIMEOUT_S, MAX_CONNECTIONS, MAX_PIXELS_IN_FLIGHT,
                     MAX_REQUEST_PIXELS)
from .media import load_images, load_videos, with_images
from .metrics import CONTENT_TYPE, Counted, Metrics
from .pixel_budget import PixelBudget
from . import responses_api
from .request import ChatRequest, parse_body, parse_json, parse_request
from .responses import ToolReader, chat_stream, completion, new_id
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("vlmrt.serve")
MAX_BODY = 32 * 1024 * 1024
DRAIN = 64 * 1024 * 1024  # a body over the limit is read (and dropped) this far, so that the client sees the 413


# the chat page talks only to its own server, shows only data: images, and is never framed by another page
# (clickjacking: it may hold the API key); its one script and style are inline
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
                               "form-action 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
}


@dataclass
class Config:
    model_id: str
    media_dir: Path | None = None
    max_images: int = 8
    max_body: int = MAX_BODY
    fetch: FetchLimits = FetchLimits(addresses=AddressPolicy())  # image URLs: public addresses only
    mode: str | None = None  # VLM.chat's mode (None: the bundle's default)
    body_timeout_s: float = BODY_TIMEOUT_S  # the whole body must arrive within this (else 408)
    api_keys: tuple[str, ...] = ()  # none: no key needed
    host_check: bool = True  # Host must be a loopback name (with the port) or in allowed_hosts (bound to loopback)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    head_timeout_s: float = HEAD_TIMEOUT_S  # the request line and headers (protocol.py)
    max_connections: int = MAX_CONNECTIONS  # uvicorn's limit_concurrency
    max_request_pixels: int = MAX_REQUEST_PIXELS  # decoded pixels of a request's images (else 413)
    max_pixels_in_flight: int = MAX_PIXELS_IN_FLIGHT  # of every request between decode and answer (else 503)
    image_spec: object = None  # the bundle's manifest.image: how small a large JPEG may be decoded (pixel_budget.py)

    def middleware(self) -> list[Middleware]:
        """access.py's layers, outermost first."""
        out = [Middleware(HeadSize)]
        if self.host_check or self.allowed_hosts:
            out.append(Middleware(HostCheck, allowed=self.allowed_hosts))
        if self.cors_origins:
            out.append(Middleware(Cors, origins=self.cors_origins))
        out.append(Middleware(OriginCheck, origins=self.cors_origins))
        if self.api_keys:
            out.append(Middleware(ApiKeys, keys=self.api_keys))
        return out


class State:
    def __init__(self):
        self.scheduler: Scheduler | None = None
        self.error: str | None = None


def _error(e: APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    size = request.headers.get("content-length", "")
    chunks, n = [], 0
    over = size.isdigit() and int(size) > limit
    try:
        async with asyncio.timeout(timeout_s):  # a body that drips (or stops) does not hold the connection
            async for c in request.stream():
                n += len(c)
                over = over or n > limit
                if over and n > DRAIN:
                    break
                if not over:
                    chunks.append(c)
    except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", "invalid_request_error",
                       "request_timeout") from None
    if over:
        raise APIError(413, f"the request body is over the server's limit of {limit} bytes", "invalid_request_error",
                       "request_too_large")
    return b"".join(chunks)


async def _watch(receive, sched: Scheduler, job: Job) -> None:
    """Cancel the job when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass
    sched.cancel(job)


class EventStream(Response):
    """Server-sent events from an async iterator of bytes; on_close runs however the stream ends."""

    def __init__(self, events, on_close: Callable[[], None]):
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            pass
        finally:
            self.on_close()


def create_app(load: Callable[[], Scheduler], config: Config, on_load_error: Callable[[str], None] | None = None):
    state = State()

    def loader():
        try:
            t = time.perf_counter()
            state.scheduler = load()
            log.info("model %s ready in %.1f s", config.model_id, time.perf_counter() - t)
        except Exception as e:
            state.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.error("loading failed: %s", state.error)
            if on_load_error:
                on_load_error(state.error)

    fetch_pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="vlmrt-fetch")
    pixels = PixelBudget(config.max_request_pixels, config.max_pixels_in_flight, config.image_spec)
    decode_pool = None  # the event loop's default executor
    metrics = Metrics(state, pixels)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=loader, name="vlmrt-load", daemon=True).start()
        yield
        fetch_pool.shutdown(wait=False, cancel_futures=True)
        if state.scheduler is not None:
            state.scheduler.close()

    def ready() -> Scheduler:
        if state.scheduler is None:
            raise unavailable(f"the model failed to load: {state.error}" if state.error else "the model is loading",
                              "load_failed" if state.error else "loading")
        return state.scheduler

    async def health(request: Request):
        if state.scheduler is None:
            return JSONResponse({"status": "error" if state.error else "loading", "error": state.error}, status_code=503)
        return JSONResponse({"status": "ok", "model": config.model_id, **state.scheduler.status(),
                             "pixels_in_flight": pixels.held, "refused_pixels_in_flight": pixels.refused})

    async def models(request: Request):
        meta = {"max_context": state.scheduler.max_context, "slots": len(state.scheduler.slots)} if state.scheduler else {}
        return JSONResponse({"object": "list", "data": [{"id": config.model_id, "object": "model", "created": 0,
                                                         "owned_by": "vlmrt", "meta": meta}]})

    async def scrape(request: Request):
        return Response(metrics.page(), media_type=CONTENT_TYPE)

    async def page(request: Request):
        return HTMLResponse(resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8"),
                            headers=PAGE_HEADERS)

    async def answer(request: Request, req: ChatRequest, stream_of, whole_of):
        """Answer a checked request: its media decoded, queued, then stream_of(events) (an async iterator of the
        stream's bytes, from _events) or whole_of(Finished) (the JSON answer)."""
        sched = ready()
        if req.video_urls and sched.no_video:  # before a video's bytes are fetched, read or decoded
            raise bad_request(sched.no_video, "invalid_content_part")
        fetches = any(re.match(r"(?i)https?://", u) for u in req.urls + req.video_urls)  # slow ones on their own threads
        loop = asyncio.get_running_loop()
        if any(req.options.get(k) for k in ("response_format", "tool_choice")) or any(
                t["function"].get("strict") for t in req.options.get("tools") or ()):
            try:  # the grammar compiled here, off the model thread (the first one builds the tokenizer's trie)
                await loop.run_in_executor(decode_pool, sched.compile, req.options)
            except GrammarError as e:
                raise APIError(400, str(e), "invalid_request_error", "invalid_parameter", param=e.param) from None
        held = pixels.hold()  # the decoded pixels of its images, until it is answered (pixel_budget.py)
        try:
            images = await loop.run_in_executor(fetch_pool if fetches else decode_pool, load_images, req.urls,
                                                config.media_dir, config.fetch, held)
            videos = await loop.run_in_executor(fetch_pool if fetches else decode_pool, load_videos, req.video_urls,
                                                config.media_dir, config.fetch) if req.video_urls else []
            req.options.setdefault("max_new_tokens", sched.max_context)
            req.options["mode"] = config.mode
            job = Job(with_images(req.messages, images, videos), req.key, req.options, asyncio.get_running_loop())
            del images
            try:
                sched.submit(job)
            except QueueFull:
                raise unavailable(f"all {len(sched.slots)} slots are busy and the queue ({sched.max_queue}) is full; "
                                  "retry later", "queue_full") from None
        except BaseException:
            held.release()
            raise
        watcher = asyncio.ensure_future(_watch(request.receive, sched, job))

        def close():
            watcher.cancel()
            sched.cancel(job)  # no-op for a finished job
            held.release()

        owned = True  # until a stream takes the job over
        try:
            first = await job.events.get()
            if first[0] == "error":
                raise first[1]
            if req.stream:
                stream = EventStream(stream_of(_events(job, first, metrics)), close)
                owned = False
                return stream
            ev = first
            while ev[0] in ("piece", "logprobs"):  # the answer's text (and logprobs) come whole with "done"
                ev = await job.events.get()
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "cancelled":
                return _error(APIError(499, "the client closed the request", "invalid_request_error", "cancelled"))
            metrics.finished(ev[1])
            return JSONResponse(whole_of(ev[1]))
        finally:
            if owned:
                close()

    def tool_reader(req: ChatRequest) -> ToolReader | None:
        """How the answer's tool calls are read (None: no tools); a 400 for a template that takes none."""
        if not req.tools:
            return None
        template = ready().slots[0].vlm.template  # (every slot's VLM renders with the bundle's template)
        if template.tools_refusal():
            raise APIError(400, f"tools: {template.tools_refusal()}", "invalid_request_error",
                           "unsupported_parameter", param="tools")
        return ToolReader(template.tool_format, {t["function"]["name"]: t["function"].get("parameters")
                                                 for t in req.tools})

    async def chat(request: Request):
        ready()
        req = parse_request(await read_body(request, config.max_body, config.body_timeout_s), config.max_images)
        cid, model, tools = new_id(), config.model_id, tool_reader(req)
        logprobs = req.options.get("logprobs") is not None
        return await answer(request, req, lambda events: chat_stream(events, cid, model, req.include_usage, tools,
                                                                     logprobs),
                            lambda f: completion(cid, model, f, tools))

    async def responses(request: Request):
        ready()
        body = parse_json(await read_body(request, config.max_body, config.body_timeout_s))
        try:  # (the chat checks' 400s name the fields as the Responses API names them)
            req = parse_body(responses_api.to_chat(body), config.max_images)
            rid, mid = responses_api.new_ids()
            model, tools = config.model_id, tool_reader(req)
            return await answer(request, req, lambda events: responses_api.stream(events, rid, mid, model, body, tools),
                                lambda f: responses_api.response(rid, mid, model, body, f, tools))
        except APIError as e:
            raise responses_api.renamed(e) from None

    async def api_error(request: Request, e: APIError):
        headers = {503: {"Retry-After": "1"},  # queue full, loading
                   408: {"Connection": "close"}}.get(e.status)  # the rest of a slow body is never read
        return _error(e, headers=headers)

    async def http_error(request: Request, e: HTTPException):
        kind = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}
        t, c = kind.get(e.status_code, ("invalid_request_error", "http_error"))
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return _error(APIError(e.status_code, msg, t, c), headers=e.headers)

    async def server_error(request: Request, e: Exception):
        log.error("unhandled error on %s %s: %r (traceback below)", request.method, request.url.path, e)
        metrics.count(request.url.path, 500)  # (sent outside the middleware that counts the others)
        return _error(internal())

    routes = [Route("/", page), Route("/health", health), Route("/metrics", scrape), Route("/v1/models", models),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/responses", responses, methods=["POST"])]
    metrics.routes = frozenset(r.path for r in routes)  # counted by name; any other path as "other"
    middleware = [Middleware(Counted, metrics=metrics)] + config.middleware()  # counted outermost: refusals too
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.vlmrt = state  # .scheduler once loaded (tests, benchmarks)
    app.state.config = config
    app.state.metrics = metrics
    return app


async def _events(job: Job, first, metrics: Metrics):
    """A job's events from its first: ("piece", text) (and ("logprobs", entries)) ..., then ("done", Finished) (counted in metrics) or
    ("error", APIError) (after the first piece: the stream has begun, so the renderer sends it as an event); a
    cancelled job (its client gone) ends without either."""
    kind, value = first
    while kind in ("piece", "logprobs"):
        yield kind, value
        kind, value = await job.events.get()
    if kind == "done":
        metrics.finished(value)
    if kind in ("done", "error"):
        yield kind, value
