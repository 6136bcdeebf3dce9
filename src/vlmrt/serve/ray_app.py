"""`vlmrt serve --ray`: the server as a Ray Serve application (docs/server.md#serving-on-ray).

    client -> Serve's HTTP proxy -> Ingress (app.py's Starlette app: access layers, limits, media, over a
              RemoteScheduler) -> Model replicas (each the bundle loaded once under a Scheduler: --slots slots)

    vlmrt serve BUNDLE --ray --replicas 1..4 --slots 4                     # a local Ray cluster on 127.0.0.1
    serve run vlmrt.serve.ray_app:build bundle=BUNDLE replicas=2 args="--slots 4 --api-key KEY"   # a Serve config

The ingress reads, checks and decodes a request as `vlmrt serve` does, then relays its job to a Model replica through
a DeploymentHandle; the replica's Scheduler runs it and streams its events back. The ConversationRouter
(ray_router.py) picks the replica: a conversation whose earlier turns a replica was sent goes back there unless that
replica's queue is longer than the shortest by more than --slots; a new conversation goes by load (the shorter queue
of two). A replica that dies before the answer's first piece: the job is relayed once more (nothing was sent yet);
after it: the stream ends with an error event (503 replica_failed), never a retried, duplicated text.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import shlex
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from ..runtime.decode.grammar import GrammarError
from .errors import APIError, internal, unavailable
from .limits import KEEP_ALIVE_S
from .ray_router import ConversationRouter, conversation_digests
from .scheduler import Job, QueueFull

log = logging.getLogger("vlmrt.serve")
APP = "vlmrt"
# a replica that died or could not be reached (not an error of the request itself)
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.LocalRayletDiedError)


@dataclass
class Ask:
    """One job for a Model replica. conversation: the chained digests of its messages (ray_router.py: what the
    router keys the replica holding the conversation by); payload: VLM.chat's messages, images decoded; key: the slot
    affinity key (request.py); options: VLM.chat's keyword arguments."""

    conversation: tuple[str, ...]
    payload: list[dict]
    key: list
    options: dict


def _wire(e: APIError) -> tuple:
    return e.status, e.message, e.type, e.code, e.extra


def _unwire(w: tuple) -> APIError:
    return APIError(*w[:4], **w[4])


def replica_range(text: str) -> tuple[int, int]:
    """--replicas N or MIN..MAX -> (min, max)."""
    lo, sep, hi = str(text).partition("..")
    try:
        r = (int(lo), int(hi if sep else lo))
    except ValueError:
        r = (0, 0)
    if not 1 <= r[0] <= r[1]:
        raise ValueError(f"--replicas {text}: N or MIN..MAX, 1 <= MIN <= MAX")
    return r


def pin(rank: int, threads: int) -> list[int]:
    """Pin this process (every thread) to `threads` cores of the node, the rank-th group of them."""
    cores = sorted(os.sched_getaffinity(0))
    mine = {cores[(rank * threads + i) % len(cores)] for i in range(threads)}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(mine)


class Model:
    """A replica: the bundle loaded once, a Scheduler over it (its --slots slots and --queue), jobs streamed back."""

    def __init__(self, a, bundle: str):
        from .prepare import prepare

        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self.cores = pin(ctx.rank.local_rank, a.threads) if a.pin_cores else sorted(os.sched_getaffinity(0))
        load, _ = prepare(a, bundle)
        self.sched = load()

    async def generate(self, ask: Ask):
        """("piece", text) (and ("logprobs", entries)) ... then ("done", Finished) | ("error", wired APIError) |
        ("cancelled", None)."""
        loop = asyncio.get_running_loop()
        if any(ask.options.get(k) for k in ("response_format", "tool_choice", "tools")):
            try:  # the grammar compiled before the job queues, off the model thread (as app.py does on one machine)
                await loop.run_in_executor(None, self.sched.compile, ask.options)
            except GrammarError as e:
                yield "error", _wire(APIError(400, str(e), "invalid_request_error", "invalid_parameter", param=e.param))
                return
        job = Job(ask.payload, ask.key, ask.options, loop)
        try:
            self.sched.submit(job)
        except QueueFull:
            yield "error", _wire(unavailable(f"the replica's {len(self.sched.slots)} slots are busy and its queue "
                                             f"({self.sched.max_queue}) is full; retry later", "queue_full"))
            return
        try:
            while True:
                kind, value = await job.events.get()
                yield kind, _wire(value) if kind == "error" else value
                if kind not in ("piece", "logprobs"):
                    return
        finally:  # the ingress cancelled it (its client went away) or it ended: a no-op then
            self.sched.cancel(job)

    def info(self) -> dict:
        s = self.sched
        return {"replica": self.replica, "pid": os.getpid(), "cores": self.cores, "max_context": s.max_context,
                "no_video": s.no_video, "max_queue": s.max_queue, **s.status()}

    def __del__(self):
        sched = self.__dict__.get("sched")
        if sched is not None:
            sched.close()


class RemoteScheduler:
    """The app's scheduler (the Scheduler's submit / cancel / status) over the Model replicas: a submitted job is
    relayed to the replica the router picks, its events put on the job's queue as a local Scheduler would."""

    def __init__(self, handle, info: dict):
        self.handle = handle.options(stream=True)
        self.max_context, self.max_queue = info["max_context"], info["max_queue"]
        # a video is fetched, read and checked here (serve/media.py); its Clip crosses to the replica as the file's
        # bytes, which the replica reads again (runtime/media/video.py Clip.__reduce__)
        self.no_video = info["no_video"]
        self.slots = [None] * info["slots"]  # a replica's
        self.relays: dict[Job, asyncio.Task] = {}
        self.counts: Counter = Counter()

    def compile(self, options: dict) -> None:
        """Nothing here: the replica compiles the job's grammar before it queues (Model.generate; a bad one is its
        400)."""

    def submit(self, job: Job) -> None:
        self.relays[job] = asyncio.ensure_future(self._relay(job))

    def cancel(self, job: Job) -> None:
        task = self.relays.pop(job, None)
        if task is not None and not task.done():
            task.cancel()
            self.counts["cancelled"] += 1

    def status(self) -> dict:
        return {"slots": len(self.slots), "busy": sum(not t.done() for t in self.relays.values()), "queued": 0,
                "ray": True, **self.counts}

    def close(self) -> None:
        for task in self.relays.values():
            task.cancel()

    async def _relay(self, job: Job) -> None:
        ask = Ask(conversation_digests(job.key), job.messages, job.key, job.options)
        for attempt in (1, 2):
            pieces, gen = 0, self.handle.generate.remote(ask)
            try:
                async for kind, value in gen:
                    job.events.put_nowait((kind, _unwire(value) if kind == "error" else value))
                    pieces += kind in ("piece", "logprobs")  # (either sent: the job is not run again)
                self.counts["answered"] += 1
                return
            except BackPressureError:
                self.counts["refused"] += 1
                job.events.put_nowait(("error", unavailable("every replica's slots and queue are full; retry later",
                                                            "queue_full")))
                return
            except REPLICA_GONE as e:
                if pieces == 0 and attempt == 1:  # nothing was sent: the job runs again on another replica
                    self.counts["relayed_again"] += 1
                    log.warning("a replica stopped before answering (%s): relaying the request again", type(e).__name__)
                    continue
                self.counts["replica_failed"] += 1
                job.events.put_nowait(("error", APIError(
                    503, f"the replica generating this answer stopped after {pieces} pieces ({type(e).__name__}); "
                         "the answer is incomplete: retry", "unavailable_error", "replica_failed")))
                return
            except Exception as e:  # a bug on the replica's side, or the job would not pickle: never a hang
                log.error("a relayed request failed: %s", str(e).strip().splitlines()[0] if str(e).strip() else e)
                job.events.put_nowait(("error", internal()))
                return
            finally:
                gen.cancel()  # the relay was cancelled (its client went away): so is the replica's job


@serve.ingress()
class Ingress:
    """app.py's Starlette app (the routes, access layers, limits and media handling of `vlmrt serve`) over a
    RemoteScheduler: what Serve's HTTP proxy sends requests to."""

    def __init__(self, model, a, bundle: str):
        self.model, self.a, self.bundle = model, a, bundle

    def __serve_build_asgi_app__(self):
        from .app import create_app
        from .prepare import prepare

        _, config = prepare(self.a, self.bundle)
        handle = self.model

        def load():  # in the app's loader thread: /health is 503 "loading" until a Model replica answers
            return RemoteScheduler(handle, handle.info.remote().result())

        return create_app(load, config)


def application(a, bundle: str, **model_options):
    """The Serve application for parsed `vlmrt serve` arguments a and a bundle folder; model_options override the
    Model deployment's options (autoscaling_config's delays, ...)."""
    lo, hi = replica_range(a.replicas)
    a = copy.copy(a)
    a.threads = a.threads or 1  # a replica's intra-op threads: one core each unless --threads says more
    # a replica takes its slots and queue; past them requests wait in the router (at most --queue of them, Serve's
    # least being 1), then get 503 queue_full
    opts = dict(max_ongoing_requests=a.slots + a.queue, max_queued_requests=max(1, a.queue),
                ray_actor_options={"num_cpus": a.threads},
                request_router_config=RequestRouterConfig(
                    request_router_class=ConversationRouter,
                    # a follow-up goes to its replica while its queue is at most a replica's slots longer
                    request_router_kwargs={"slack": a.slots}))
    if lo == hi:
        opts["num_replicas"] = lo
    else:
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": a.slots}
    opts.update(model_options)
    model = serve.deployment(Model).options(name="Model", **opts).bind(a, bundle)
    # --max-connections N: N requests at once in the ingress (streams included), N more in the proxy's queue (which
    # also holds requests still being routed: a smaller one refused bursts to an idle ingress), past them Serve's
    # 503; Serve's proxy has no limit on connections themselves (PROXY_LIMITS)
    return serve.deployment(Ingress).options(name="Ingress", num_replicas=1, max_ongoing_requests=a.max_connections,
                                             max_queued_requests=a.max_connections,
                                             ray_actor_options={"num_cpus": 0}).bind(model, a, bundle)


def build(args: dict):
    """The application builder a Serve config names (import_path: vlmrt.serve.ray_app:build): args bundle (a folder),
    replicas (N or MIN..MAX, default 1) and args (the rest of the `vlmrt serve` arguments as one string)."""
    from .arguments import add_arguments

    unknown = set(args) - {"bundle", "replicas", "args"}
    if unknown or "bundle" not in args:
        raise ValueError(f"vlmrt.serve.ray_app:build takes bundle=DIR [replicas=N|MIN..MAX] [args='--slots 4 ...'] "
                         f"(got {sorted(args)})")
    ap = argparse.ArgumentParser(prog="vlmrt serve")
    add_arguments(ap)
    a = ap.parse_args([str(args["bundle"]), *shlex.split(str(args.get("args", ""))),
                       "--replicas", str(args.get("replicas", "1")), "--ray"])
    return application(a, a.bundle)


def start_ray(address: str) -> None:
    """Join the cluster at address, or ("local") start one on 127.0.0.1 (no dashboard)."""
    quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
    if ray.is_initialized():
        return
    if address != "local":
        ray.init(address=address, **quiet)
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **quiet)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# what of `vlmrt serve`'s connection limits Serve's HTTP proxy (its own uvicorn: ray/serve/_private/http_util.py
# start_asgi_http_server, no protocol class, no limit_concurrency) cannot hold; said at startup and in docs/server.md
PROXY_LIMITS = ("vlmrt: through Ray Serve's proxy --head-timeout does not hold (a client's partial request head keeps "
                "its connection open until the client closes it) and --max-connections limits requests in flight, "
                "not idle connections: put a proxy with a header timeout and a connection limit in front if clients "
                "are untrusted")


def http_options(host: str, port: int) -> dict:
    """Serve's HTTP options for the proxy: `vlmrt serve`'s keep-alive (an idle connection closed after KEEP_ALIVE_S)."""
    return {"host": host, "port": port, "keep_alive_timeout_s": KEEP_ALIVE_S}


def run_on_ray(a, bundle: str) -> int:
    from .prepare import exposure_warning, prepare

    lo, hi = replica_range(a.replicas)
    _, config = prepare(a, bundle)  # bad arguments fail before a cluster starts
    start_ray(a.ray)
    # SIGTERM ends the wait below (or a start still in progress) cleanly: set after ray.init, whose own handler
    # (abseil's, "SIGTERM received") would otherwise replace it, and before the deployment, which may take long
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    port = a.port or free_port(a.host)
    try:
        try:
            serve.start(http_options=http_options(a.host, port))
            print(f"vlmrt: deploying {Path(bundle).name} on Ray Serve ({lo if lo == hi else f'{lo}..{hi}'} replicas "
                  f"x {a.slots} slots) ...", file=sys.stderr, flush=True)
            serve.run(application(a, bundle), name=APP, route_prefix="/", blocking=False)
        except Exception as e:  # a replica that could not load the bundle, a port taken on the cluster, ...
            raise ValueError(f"the Serve application did not start: {str(e).strip().splitlines()[0]}") from None
        print(f"vlmrt: serving {Path(bundle).name} on http://{a.host}:{port}/ through Ray Serve", file=sys.stderr,
              flush=True)
        print(PROXY_LIMITS, file=sys.stderr, flush=True)
        warning = exposure_warning(a.host, config.api_keys)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
