"""GET /metrics: the server's Prometheus metrics (text format, prometheus_client), one registry per app.

    metrics = Metrics(state, pixels)           # .routes: the paths counted by name (any other one as "other")
    Middleware(Counted, metrics=metrics)       # counts every answer by route and status (the access layers' too)
    metrics.finished(f)                        # a Finished answer: tokens, TTFT, inter-token latency, images
    metrics.page()                             # what a scrape gets: the above + the scheduler's state, read now

What the server observes, and how (docs/server.md, "Metrics"): requests are counted where their answer starts (a
stream's status is its first event's: a stream that fails later is a 200 here, with an error event); tokens and
latencies come from each answer's Finished (the scheduler's RunStats): TTFT is the queue wait plus the answer's own
time to its first token, inter-token latency each gap between the answer's tokens as the scheduler's rounds brought
them (Finished.token_gaps). Queue depth, busy slots, cache bytes and rows and the scheduler's outcome counts are read
from Scheduler.status() when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: from tens of milliseconds (a cached prompt) to a minute (a large image on a slow CPU, a long queue)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _SchedulerState:
    """A collector that reads the scheduler's state (and the decoded-pixel budget's) at each scrape."""

    def __init__(self, state, pixels):
        self.state, self.pixels = state, pixels

    def collect(self):
        up = GaugeMetricFamily("vlmrt_model_loaded", "1 once the model has loaded (/health is 200)")
        sched = self.state.scheduler
        up.add_metric([], 0 if sched is None else 1)
        yield up
        held = GaugeMetricFamily("vlmrt_pixels_in_flight", "decoded image pixels held by requests not yet answered")
        held.add_metric([], self.pixels.held)
        yield held
        refused = CounterMetricFamily("vlmrt_pixels_refused", "requests refused (503) over --max-pixels-in-flight")
        refused.add_metric([], self.pixels.refused)
        yield refused
        if sched is None:
            return
        st = sched.status()
        for name, key, doc in (("vlmrt_slots", "slots", "slots (concurrent answers)"),
                               ("vlmrt_slots_busy", "busy", "slots answering a request"),
                               ("vlmrt_queue_depth", "queued", "requests waiting for a slot"),
                               ("vlmrt_kv_cache_bytes", "kv_cache_bytes",
                                "bytes of the slots' KV caches (allocated at load: max_context rows each)"),
                               ("vlmrt_kv_cache_rows", "kv_cache_rows", "KV cache rows of all slots (slots x max_context)"),
                               ("vlmrt_kv_cache_rows_used", "kv_cache_rows_used",
                                "KV cache rows the slots hold: their answers' and the last conversations' kept for "
                                "prefix reuse"),
                               ("vlmrt_image_cache_bytes", "image_cache_bytes",
                                "bytes of image embeddings the slots' image caches hold")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], st[key])
            yield g
        jobs = CounterMetricFamily("vlmrt_scheduler_jobs", "requests the scheduler ended, by outcome",
                                   labels=["outcome"])
        for outcome in ("completed", "cancelled", "refused", "failed"):
            jobs.add_metric([outcome], st.get(outcome, 0))
        yield jobs
        if st["batched"]:
            calls = CounterMetricFamily("vlmrt_batch_calls", "batched decoder calls")
            calls.add_metric([], st["batch_calls"])
            rows = CounterMetricFamily("vlmrt_batch_rows", "answers advanced by batched decoder calls, summed")
            rows.add_metric([], st["batch_rows"])
            yield calls
            yield rows


class Metrics:
    def __init__(self, state, pixels):
        """state: app.State (its .scheduler once loaded); pixels: the app's PixelBudget."""
        self.routes: frozenset[str] = frozenset()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("vlmrt_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("vlmrt_prompt_tokens", "prompt tokens of finished answers", registry=r)
        self.cached_tokens = Counter("vlmrt_cached_prompt_tokens",
                                     "prompt tokens whose KV rows were reused from the slot's cache", registry=r)
        self.generated_tokens = Counter("vlmrt_generated_tokens", "tokens generated by finished answers", registry=r)
        self.answers = Counter("vlmrt_answers", "finished answers, by stop reason (eos, stop, length, context)",
                               ["stop_reason"], registry=r)
        self.images = Counter("vlmrt_images", "images and video frames of finished answers", registry=r)
        self.images_cached = Counter("vlmrt_images_cached",
                                     "images and video frames whose embeddings came from the image cache", registry=r)
        self.ttft = Histogram("vlmrt_time_to_first_token_seconds",
                              "from queued to the first generated token (queue wait + preprocess + vision + prefill)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue = Histogram("vlmrt_queue_wait_seconds", "from queued to a slot", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vlmrt_inter_token_latency_seconds",
                             "the time before each generated token after the first (the scheduler's rounds)",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("vlmrt_answer_duration_seconds", "from queued to the answer's end",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.grammar_compile = Histogram("vlmrt_grammar_compile_seconds",
                                         "compiling a response format's or forced tool call's grammar (llguidance; "
                                         "a grammar from the cache is not counted)", buckets=COMPILE_BUCKETS, registry=r)
        r.register(_SchedulerState(state, pixels))

    def route(self, path: str) -> str:
        return path if path in self.routes else "other"  # bounded label values: no client-chosen paths

    def count(self, path: str, status: int) -> None:
        self.requests.labels(self.route(path), str(status)).inc()

    def finished(self, f) -> None:
        s = f.stats
        self.prompt_tokens.inc(f.prompt_tokens)
        self.cached_tokens.inc(s["reused_prompt_tokens"])
        self.generated_tokens.inc(f.completion_tokens)
        self.answers.labels(f.stop_reason).inc()
        self.images.inc(s["images"])
        self.images_cached.inc(s["images_cached"])
        self.queue.observe(f.queue_s)
        if f.completion_tokens:
            self.ttft.observe(f.queue_s + s["ttft_s"])
        for gap in f.token_gaps:
            self.itl.observe(gap)
        self.duration.observe(f.queue_s + s["total_s"])
        if s.get("grammar_compile_s"):
            self.grammar_compile.observe(s["grammar_compile_s"])

    def page(self) -> bytes:
        return generate_latest(self.registry)


class Counted:
    """ASGI middleware (outermost): counts each answer by route and status when it starts. (An unhandled error's 500
    is sent by Starlette outside every middleware: the app's handler counts it.)"""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.count(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)
