"""`vlmrt serve`: its arguments, and the launch: check the bundle, bind the port, load in the background, run uvicorn.

    vlmrt serve [BUNDLE] [--host 127.0.0.1] [--port 8080] [--slots 4] [--queue 16] [--media-dir DIR] ...

Bad arguments (no such bundle, the port taken, a missing extra) fail before anything listens, with one
`vlmrt: error:` line (raised as ValueError for cli.main); a bundle that fails to load stops the server the same way.
Running runs the same server in a thread of this process (tests, benchmarks).
"""

from __future__ import annotations

import math
import socket
import sys
import threading
from pathlib import Path


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a chat page (pip install 'vlmrt[serve]')")
    s.add_argument("bundle", nargs="?", default=None,
                   help="bundle folder (default: the offline easy-VQA demo model, exported on first use)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any free port)")
    s.add_argument("--slots", type=int, default=4,
                   help="concurrent conversations, each with its own KV and prefix cache (default 4)")
    s.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; more get 503 (default 16)")
    s.add_argument("--media-dir", default=None,
                   help="a folder image_url paths may name (default: none; only data URIs and http(s) URLs)")
    s.add_argument("--max-images", type=int, default=8, help="images per request (default 8)")
    s.add_argument("--max-body-mb", type=float, default=32, help="request body limit in MiB (default 32; over: 413)")
    s.add_argument("--image-cache-mb", type=float, default=64, help="image embedding cache, all slots (default 64)")
    s.add_argument("--mode", choices=["kv", "hybrid"], default=None,
                   help="prompt feeding (default: the bundle's, hybrid). A follow-up reuses the KV rows of full "
                        "prefill blocks only in hybrid mode, every row in kv mode")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda", "htp"])
    s.add_argument("--threads", type=int, default=None, help="intra-op threads (default: physical cores)")
    s.add_argument("--lookahead", type=int, default=0, metavar="N",
                   help="lookahead decoding of greedy answers, up to N drafted tokens per step (default 0: off)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(fn=run)


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: not a port number")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build(a, bundle: str, on_load_error=None):
    """The app for parsed arguments a and a bundle folder (checked here, loaded at startup)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("vlmrt serve needs the serve extra: pip install 'vlmrt[serve]'") from None
    from ..manifest import load as load_manifest
    from ..runtime.bundle import Bundle
    from ..runtime.sources import FetchLimits
    from .app import Config, create_app
    from .scheduler import Scheduler

    sizes_ok = all(math.isfinite(x) for x in (a.max_body_mb, a.image_cache_mb))  # NaN passes the comparisons below
    if not sizes_ok or a.slots < 1 or a.queue < 0 or a.max_images < 1 or a.max_body_mb <= 0 or a.image_cache_mb < 0:
        raise ValueError("--slots, --max-images and --max-body-mb must be > 0, --queue and --image-cache-mb >= 0 "
                         "(finite numbers)")
    media = Path(a.media_dir) if a.media_dir else None
    if media is not None and not media.is_dir():
        raise ValueError(f"--media-dir {media}: not a folder")
    from ..runtime.bundle import check_threads
    from ..runtime.engine import check_lookahead
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
        return Scheduler(b, a.slots, a.queue, time.perf_counter() - t,
                         image_cache_bytes=int(a.image_cache_mb * 2**20 / a.slots), lookahead=a.lookahead)

    config = Config(model_id=Path(bundle).name, media_dir=media, max_images=a.max_images,
                    max_body=int(a.max_body_mb * 2**20), fetch=FetchLimits(), mode=a.mode)
    return create_app(load, config, on_load_error)


def _server(app, log_level: str):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, ws="none",
                                         lifespan="on"))


def run(a) -> int:
    if a.bundle is None:
        from ..demo.default_model import ensure_bundle

        bundle = str(ensure_bundle(progress=True))
    else:
        bundle = a.bundle
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
