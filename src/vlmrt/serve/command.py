"""`vlmrt serve`: its arguments, and the launch: check the bundle, bind the port, load in the background, run uvicorn.

    vlmrt serve [BUNDLE] [--host 127.0.0.1] [--port 8080] [--slots 4] [--queue 16] [--media-dir DIR] ...

Bad arguments (no such bundle, the port taken, a missing extra) fail before anything listens, with one
`vlmrt: error:` line (raised as ValueError for cli.main); a bundle that fails to load stops the server the same way.
Running runs the same server in a thread of this process (tests, benchmarks).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from pathlib import Path

from .limits import (BACKLOG, BODY_TIMEOUT_S, HEAD_MAX_BYTES, HEAD_TIMEOUT_S, KEEP_ALIVE_S, MAX_CONNECTIONS,
                     MAX_PIXELS_IN_FLIGHT, MAX_REQUEST_PIXELS)


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a chat page (pip install 'vlmrt[serve]')")
    s.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported on first use)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    s.add_argument("--slots", type=int, default=4,
                   help="concurrent conversations, each with its own KV rows and prefix cache; a bundle whose decoder "
                        "takes a batch decodes them together, one decoder call per step (default 4)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; more get 503 (default 16)")
    s.add_argument("--media-dir", default=None,
                   help="a folder image_url paths may name (default: none; only data URIs and http(s) URLs)")
    s.add_argument("--max-images", type=int, default=8, help="images per request (default 8)")
    s.add_argument("--max-body-mb", type=float, default=32, help="request body limit in MiB (default 32; over: 413)")
    s.add_argument("--max-request-pixels", type=float, default=MAX_REQUEST_PIXELS / 1e6, metavar="MP",
                   help=f"decoded pixels of one request's images together, in millions, read from their headers "
                        f"before decoding (a large JPEG counts at the size it is decoded to); over: 413 (default "
                        f"{MAX_REQUEST_PIXELS / 1e6:g}; each image also at most 120)")
    s.add_argument("--max-pixels-in-flight", type=float, default=MAX_PIXELS_IN_FLIGHT / 1e6, metavar="MP",
                   help=f"decoded pixels of all requests from their decode to their answer, in millions; a request "
                        f"that would pass it gets 503 with Retry-After (default {MAX_PIXELS_IN_FLIGHT / 1e6:g})")
    s.add_argument("--image-cache-mb", type=float, default=64, help="image embedding cache, all slots (default 64)")
    s.add_argument("--mode", choices=["kv", "hybrid"], default=None,
                   help="prompt feeding (default: the bundle's, hybrid). A follow-up reuses the KV rows of full "
                        "prefill blocks only in hybrid mode, every row in kv mode")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    s.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    s.add_argument("--lookahead", type=int, default=0, metavar="N",
                   help="lookahead decoding of greedy answers, up to N drafted tokens per step (default 0: off)")
    s.add_argument("--no-batch-padding", action="store_true",
                   help="a request decoding alone runs one-row calls even where they round apart from multi-row ones "
                        "(w4a16 everywhere, w4a8 on AVX2-only CPUs; docs/server.md#continuous-batching): faster alone "
                        "(w4a16: 2.6x), but an answer can then depend on the load")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = s.add_argument_group("Ray Serve (docs/server.md#serving-on-ray; pip install 'vlmrt[serve-ray]')")
    r.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="serve as a Ray Serve application: replicas of the model behind Serve's HTTP proxy on "
                        "--host/--port, each follow-up routed to the replica holding its conversation; ADDRESS: a "
                        "cluster to join (ray://HEAD:10001, auto), none: a local cluster on 127.0.0.1")
    r.add_argument("--replicas", default="1", metavar="N|MIN..MAX",
                   help="model replicas (each loads the bundle once, runs --slots slots): N, or MIN..MAX to "
                        "autoscale on ongoing requests, --slots per replica (default 1)")
    r.add_argument("--pin-cores", action="store_true",
                   help="pin each replica to its own --threads cores of its node (by its rank there)")
    g = s.add_argument_group("security (docs/server.md#security)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but / and /health (repeatable: any of "
                        "them; default: $VLMRT_API_KEY, which other users cannot see in the process list)")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="HOST[,HOST]",
                   help="Host header values answered besides the loopback names (NAME, NAME:PORT, *.DOMAIN, *): the "
                        "name a reverse proxy passes on. Without it a server bound to loopback answers only "
                        "Host: localhost / *.localhost / 127.x / [::1], any port (DNS rebinding)")
    g.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="grant this origin (https://app.example.com; * for any) CORS, preflight included "
                        "(repeatable; default: none, and browsers' cross-origin requests are refused)")
    g.add_argument("--allow-local-urls", action="store_true",
                   help="let image URLs reach loopback, private and link-local addresses (a trusted network; "
                        "default: public addresses only)")
    g.add_argument("--no-image-urls", action="store_true", help="refuse http(s) image URLs altogether")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="requests' control-token strings (<|im_start|>, <end_of_utterance>, ...) become those tokens, "
                        "as transformers tokenizes them: a client can then forge turns (default: plain text)")
    g.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help=f"a request body must arrive whole within S seconds, else 408 (default {BODY_TIMEOUT_S:g})")
    g.add_argument("--head-timeout", type=float, default=HEAD_TIMEOUT_S, metavar="S",
                   help=f"a request's line and headers must arrive within S seconds, else 408 (default "
                        f"{HEAD_TIMEOUT_S:g})")
    g.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help=f"open connections and requests in progress; past it requests get 503 (default "
                        f"{MAX_CONNECTIONS})")
    s.set_defaults(fn=run)


def is_loopback(host: str) -> bool:
    """--host names only loopback addresses (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def exposure_warning(host: str, keys: tuple[str, ...]) -> str | None:
    """The one line `vlmrt serve` prints when it listens beyond loopback without an API key."""
    if keys or is_loopback(host):
        return None
    return (f"vlmrt: warning: listening on {host} (beyond loopback) without --api-key: anyone who can reach the port "
            "can use the model and have it fetch public image URLs")


def _list(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or () for v in item.split(",") if v.strip())


def api_keys(a) -> tuple[str, ...]:
    from .access import check_key

    if a.api_key:
        return tuple(check_key(k, "--api-key") for k in a.api_key)
    env = os.environ.get("VLMRT_API_KEY")
    return (check_key(env, "VLMRT_API_KEY"),) if env else ()


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: not a port number")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build(a, bundle: str, on_load_error=None):
    """The app for parsed arguments a and a bundle folder (checked here, loaded at startup)."""
    from .app import create_app

    load, config = prepare(a, bundle)
    return create_app(load, config, on_load_error)


def prepare(a, bundle: str):
    """(load, config) for parsed arguments a and a bundle folder: load() -> the Scheduler over the bundle (run at
    startup, in a thread), config the app's Config. Bad arguments and an unreadable bundle fail here (ValueError)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ValueError("vlmrt serve needs the serve extra: pip install 'vlmrt[serve]'") from None
    from ..format.manifest import load as load_manifest
    from ..runtime.bundle import Bundle
    from ..runtime.sources import FetchLimits
    from ..runtime.url_policy import AddressPolicy
    from .app import Config
    from .media import warm_up
    from .scheduler import Scheduler

    sizes_ok = all(math.isfinite(x) for x in (a.max_body_mb, a.image_cache_mb))  # NaN passes the comparisons below
    if not sizes_ok or a.slots < 1 or a.queue < 0 or a.max_images < 1 or a.max_body_mb <= 0 or a.image_cache_mb < 0:
        raise ValueError("--slots, --max-images and --max-body-mb must be > 0, --queue and --image-cache-mb >= 0 "
                         "(finite numbers)")
    if not all(math.isfinite(t) and t > 0 for t in (a.body_timeout, a.head_timeout)) or a.max_connections < 1:
        raise ValueError("--body-timeout and --head-timeout must be finite numbers of seconds > 0, "
                         "--max-connections >= 1")
    pixels = (a.max_request_pixels, a.max_pixels_in_flight)
    if not all(math.isfinite(x) and x > 0 for x in pixels) or a.max_request_pixels > a.max_pixels_in_flight:
        raise ValueError("--max-request-pixels and --max-pixels-in-flight must be numbers of millions of pixels > 0, "
                         "the first at most the second")
    if a.ray is None and (a.replicas != "1" or a.pin_cores):
        raise ValueError("--replicas and --pin-cores serve on Ray: add --ray")
    if a.allow_local_urls and a.no_image_urls:
        raise ValueError("--allow-local-urls and --no-image-urls contradict each other")
    keys = api_keys(a)
    from .access import HostCheck

    allowed_hosts = _list(a.allowed_hosts)
    HostCheck(None, allowed_hosts)  # a malformed entry fails now
    origins = _list(a.cors_origin)
    media = Path(a.media_dir) if a.media_dir else None
    if media is not None and not media.is_dir():
        raise ValueError(f"--media-dir {media}: not a folder")
    from ..runtime.sessions import check_threads
    from ..runtime.cache_row import check_lookahead
    from ..runtime.lookahead import check_exact

    # a missing or unreadable bundle, or a lookahead it cannot verify, fails now, not after the port opens
    check_threads(a.threads)
    m = load_manifest(bundle, verify=False)
    check_lookahead(m.decoder, a.lookahead)
    check_exact(m.graphs["decode"], a.lookahead)
    verify = a.bundle is not None  # the default model's cache was verified by ensure_bundle

    def load():
        import time

        t = time.perf_counter()
        b = Bundle.open(bundle, device=a.device, threads=a.threads, verify=verify)
        warm_up(video=b.manifest.prompt.video is not None)  # before /health turns 200: nothing to import on first use
        # the slots' VLMs get images already decoded; the policy is theirs too, should a URL ever reach one
        return Scheduler(b, a.slots, a.queue, time.perf_counter() - t, pad=not a.no_batch_padding, fetch=fetch,
                         image_cache_bytes=int(a.image_cache_mb * 2**20 / a.slots), lookahead=a.lookahead,
                         allow_special_tokens=a.allow_special_tokens)

    fetch = FetchLimits(addresses=None if a.allow_local_urls else AddressPolicy(), urls=not a.no_image_urls)
    config = Config(model_id=Path(bundle).name, media_dir=media, max_images=a.max_images,
                    max_body=int(a.max_body_mb * 2**20), fetch=fetch, mode=a.mode, body_timeout_s=a.body_timeout,
                    api_keys=keys, host_check=is_loopback(a.host), allowed_hosts=allowed_hosts, cors_origins=origins,
                    head_timeout_s=a.head_timeout, max_connections=a.max_connections,
                    max_request_pixels=max(1, int(a.max_request_pixels * 1e6)),
                    max_pixels_in_flight=max(1, int(a.max_pixels_in_flight * 1e6)), image_spec=m.image)
    return load, config


def _server(app, log_level: str):
    import uvicorn

    from .protocol import Protocol

    config = app.state.config
    protocol = type("Protocol", (Protocol,), {"head_timeout_s": config.head_timeout_s})
    # loop: asyncio's own, also where uvloop is installed (ray[serve] brings it)
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, ws="none",
                                         loop="asyncio", lifespan="on", http=protocol,
                                         h11_max_incomplete_event_size=HEAD_MAX_BYTES,
                                         limit_concurrency=config.max_connections, timeout_keep_alive=KEEP_ALIVE_S))


def run(a) -> int:
    if a.bundle is None:
        from ..demo.default_model import ensure_bundle

        bundle = str(ensure_bundle(progress=True))
    else:
        bundle = a.bundle
    if a.ray is not None:
        try:
            from .ray_app import run_on_ray
        except ImportError:
            raise ValueError("vlmrt serve --ray needs the serve-ray extra: pip install 'vlmrt[serve-ray]'") from None
        return run_on_ray(a, bundle)
    failed: list[str] = []
    server = None

    def on_load_error(msg: str):
        failed.append(msg)
        server.should_exit = True

    app = build(a, bundle, on_load_error)
    sock = bind(a.host, a.port)
    server = _server(app, a.log_level)
    host, port = sock.getsockname()[:2]
    print(f"vlmrt: serving {Path(bundle).name} on http://{host}:{port}/ ({a.slots} slots); loading ...",
          file=sys.stderr, flush=True)
    warning = exposure_warning(a.host, app.state.config.api_keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if failed:
        raise ValueError(failed[0])
    return 0


class Running:
    """A server in a thread of this process: .url, .stop()."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = app
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _server(app, log_level)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="vlmrt-serve")
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
