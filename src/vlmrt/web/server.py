"""`vlmrt web --serve`: a static file server for the site on 127.0.0.1 (stdlib http.server), with the cross-origin
isolation headers (COOP same-origin, COEP require-corp) that WASM threads need and the types browsers require for
modules and WASM. GET and HEAD of files under the folder only: no directory listings, nothing outside it. A single
byte range (`Range: bytes=A-B`, at most RANGE_BYTES) is answered 206 with its bytes: a page reads a large token table by
rows that way (static/table.js); other Range forms are ignored (200, the whole file), as HTTP allows."""

from __future__ import annotations

import functools
import io
import os
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .site import HEADERS

TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json",
         ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".npy": "application/octet-stream",
         ".html": "text/html; charset=utf-8"}
RANGE_BYTES = 64 * 1024 * 1024  # a larger single range is served as the whole file (200)


class Handler(SimpleHTTPRequestHandler):
    extensions_map = {**SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def end_headers(self) -> None:
        self.send_header("Accept-Ranges", "bytes")
        for k, v in HEADERS.items():
            self.send_header(k, v)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-cache")  # the page caches the bundle itself (Cache Storage)
        super().end_headers()

    def send_head(self):
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "").strip())
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path) or self.path.endswith("/"):
            return super().send_head()
        size = os.path.getsize(path)
        first = int(m[1])
        last = min(int(m[2]) if m[2] else size - 1, size - 1)
        if last - first + 1 > RANGE_BYTES:
            return super().send_head()
        if first > last:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        with open(path, "rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)

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
