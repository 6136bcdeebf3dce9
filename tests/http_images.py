"""A local HTTP server for image-URL tests: 127.0.0.1 only, a fixed table of routes, stopped on leaving the
`with` block or, at the latest, after `lifetime_s` (it never outlives a hung test)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve_images(routes: dict, lifetime_s: float = 120.0):
    """routes: path -> bytes (200, served as is), ("redirect", path) (302), ("sleep", seconds) (answers late),
    ("drip", seconds, n) (n bytes, one every seconds), ("flaky", n, data) (503 for the first n requests, then data);
    anything else is 404. Yields the base URL."""
    served: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            r = routes.get(self.path)
            if isinstance(r, bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(r)))
                self.end_headers()
                self.wfile.write(r)
            elif isinstance(r, tuple) and r[0] == "redirect":
                self.send_response(302)
                self.send_header("Location", r[1])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif isinstance(r, tuple) and r[0] == "drip":  # one byte every r[1] seconds, r[2] of them
                self.send_response(200)
                self.end_headers()
                for _ in range(r[2]):
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:
                        return
                    time.sleep(r[1])
            elif isinstance(r, tuple) and r[0] == "flaky":
                served[self.path] = served.get(self.path, 0) + 1
                code, body = (503, b"busy") if served[self.path] <= r[1] else (200, r[2])
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif isinstance(r, tuple) and r[0] == "sleep":
                time.sleep(r[1])
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    timer = threading.Timer(lifetime_s, server.shutdown)
    timer.daemon = True
    timer.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        timer.cancel()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
