"""A fresh `vlmrt serve` (its own process: nothing imported before it starts, unlike the in-process servers of
test_serve.py) answers the burst that arrives the instant /health turns 200: 16 concurrent image requests, each a
200 with its answer. Before the server warmed up before saying it was ready (serve/media.py warm_up) and
runtime/media/image.py's is_pil_image stopped reading a half-imported PIL.Image, 1 to 6 of the 16 answered 500
(`partially initialized module 'PIL.Image' has no attribute 'Image'`) on each of 9 fresh servers tried."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from conftest import CASES, exported

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

BURST = 16


def _post(port: int, body: bytes) -> tuple[int, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def _health(port: int) -> int | None:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/health")
        return c.getresponse().status
    except OSError:
        return None
    finally:
        c.close()


def _image_request(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 256, (20 + i, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                                 {"type": "text", "text": "what is it?"}]}],
                       "max_tokens": 2}).encode()


def test_a_burst_of_image_requests_the_instant_a_fresh_server_is_ready(tmp_path_factory):
    bundle = exported(CASES[0], tmp_path_factory).bundle
    bodies = [_image_request(i) for i in range(BURST)]
    p = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "serve", str(bundle), "--port", "0", "--slots", "4",
                          "--queue", str(BURST), "--log-level", "warning"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/", p.stderr.readline()).group(1))
        deadline = time.monotonic() + 120
        while _health(port) != 200:
            assert p.poll() is None and time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.01)
        results: list = [None] * BURST
        start = threading.Barrier(BURST)

        def one(i: int) -> None:
            start.wait()
            results[i] = _post(port, bodies[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        p.terminate()
        err = p.communicate(timeout=30)[1]
    failed = [(status, body) for status, body in results if status != 200]
    assert not failed, f"{len(failed)} of {BURST} failed, the first: {failed[0]}; server log: {err[-1500:]}"
    assert all(body["choices"][0]["message"]["content"] is not None and body["usage"]["prompt_tokens"] > 0
               for _, body in results)


def test_is_pil_image_while_another_thread_is_importing_pillow(monkeypatch):
    """PIL.Image in sys.modules before its Image class exists (another thread midway through importing it): no
    object can be a PIL image yet, and asking is not an AttributeError (what the burst above met)."""
    import types

    from vlmrt.runtime.media.image import is_pil_image

    monkeypatch.setitem(sys.modules, "PIL.Image", types.ModuleType("PIL.Image"))  # a module not yet made
    assert is_pil_image(object()) is False
    monkeypatch.undo()
    assert is_pil_image(Image.new("RGB", (1, 1))) is True
