"""`vlmrt web --serve`: a static file server for the site on 127.0.0.1 (stdlib http.server), with the cross-origin
isolation headers (COOP same-origin, COEP require-corp) that WASM threads need and the types browsers require for
modules and WASM. GET and HEAD of files under the folder only: no directory listings, nothing outside it."""

from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .site import HEADERS

TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
         ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".npy": "application/octet-stream",
         ".html": "text/html; charset=utf-8"}


class Handler(SimpleHTTPRequestHandler):
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def end_headers(self) -> None:
        for k, v in HEADERS.items():
            self.send_header(k, v)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-cache")  # the page caches the bundle itself (Cache Storage)
        super().end_headers()

    def list_directory(self, path):  # a folder without index.html is not listed
        self.send_error(404, "Not found")
        return None

    def log_message(self, format, *args) -> None:  # quiet: the CLI prints the address once
        pass


def make_server(folder: str | Path, port: int = 8000) -> ThreadingHTTPServer:
    """A server for folder on 127.0.0.1:port (0: any free port), bound but not yet serving."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: not a port number")
    handler = functools.partial(Handler, directory=str(folder))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as e:
        raise ValueError(f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}") from None
    server.daemon_threads = True
    return server


def serve_in_thread(folder: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """make_server, serving from a daemon thread (tests, benchmarks); server.shutdown() stops it."""
    server = make_server(folder, port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
