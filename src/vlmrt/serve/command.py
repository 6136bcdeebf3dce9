"""`vlmrt serve`: its arguments, and the launch: check the bundle, bind the port, load in the background, run uvicorn.

    vlmrt serve [BUNDLE] [--host 127.0.0.1] [--port 8080] [--slots 4] [--queue 16] [--media-dir DIR] ...

Bad arguments (no such bundle, the port taken, a missing extra) fail before anything listens, with one
`vlmrt: error:` line (raised as ValueError for cli.main); a bundle that fails to load stops the server the same way.
Running runs the same server in a thread of this process (tests, benchmarks).
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from .arguments import add_arguments
from .limits import BACKLOG, HEAD_MAX_BYTES, KEEP_ALIVE_S
from .prepare import exposure_warning, prepare


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a chat page (pip install 'vlmrt[serve]')")
    add_arguments(s)
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
        sock.listen(BACKLOG)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build(a, bundle: str, on_load_error=None):
    """The app for parsed arguments a and a bundle folder (checked here, loaded at startup)."""
    load, config = prepare(a, bundle)  # first: it says in one line when the serve extra is missing
    from .app import create_app

    return create_app(load, config, on_load_error)


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
