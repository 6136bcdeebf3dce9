"""Helpers of the server tests (test_serve.py, test_serve_page.py): a server in a thread on an ephemeral loopback port,
raw HTTP requests, images as data URIs, long streams that hold slots, and the module-scoped fixtures (the tiny
fixture bundle, its server, an in-process VLM for the reference answers)."""

from __future__ import annotations

import argparse
import base64
import functools
import http.client
import io
import json
import socket
import time

import numpy as np
import pytest
from PIL import Image

from conftest import ASSETS
from fixtures_tiny import tiny  # noqa: F401  (the fixture, for the server tests that import it from here)

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from vlmrt.runtime.vlm import VLM  # noqa: E402
from vlmrt.serve.command import Running, add_parser, build  # noqa: E402

TEXT = {"role": "user", "content": "hi"}
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


HOLD = "hold this slot"  # the text of a holder request (see hold_slots)


def hold_slots(r: Running) -> None:
    """Make requests that hold their slot by construction: on every slot of r's scheduler, a conversation whose last
    message is HOLD streams the first two pieces of its real answer and then never finishes on its own: its sequence
    goes on decoding (no EOS, no length; its row rewound each round, so its cache never fills) and its pieces are
    empty (the scheduler thread keeps turning, so the other slots, the queue and cancellations go on) until its client
    goes away (the cancel ends it). A test that fills the slots with them is not racing their length."""
    for slot in r.app.state.vlmrt.scheduler.slots:
        v = slot.vlm
        v.chat_answer = functools.partial(_maybe_held, v.chat_answer)
        v.stream = functools.partial(_held_stream, v, v.stream)


def _maybe_held(chat_answer, messages, **kw):
    a = chat_answer(messages, **kw)
    if messages[-1]["content"] == HOLD:
        a.held, a.max_new_tokens, a.ignore_eos = 0, 1 << 30, True  # (its sequence is made from these)
    return a


def _held_stream(vlm, stream, a, ids):
    held = getattr(a, "held", None)
    if held is None or held < 2:
        for piece in stream(a, ids):
            if held is not None:
                a.held = held = held + 1
            yield piece
        return
    if held == 2:  # from here on: the row stays at this length, the prefix cache records nothing
        a.held, a.recording, a.hold_at = 3, False, vlm.row.cache.length - len(ids)
    vlm.row.cache.rewind(a.hold_at)
    yield ""


def start(bundle, *args) -> Running:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    a = ap.parse_args(["serve", str(bundle), *args])
    r = Running(build(a, str(bundle)))
    for _ in range(600):  # bounded: 60 s
        if get(r, "/health")[0] == 200:
            hold_slots(r)
            return r
        time.sleep(0.1)
    r.stop()
    raise AssertionError("the server did not become ready")


def request(r: Running, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    c = http.client.HTTPConnection("127.0.0.1", r.port, timeout=60)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = c.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data[:1] in (b"{", b"[") else data), dict(resp.getheaders())
    finally:
        c.close()


def get(r, path):
    try:
        return request(r, "GET", path)
    except OSError:
        return None, None, None


def post(r, obj, raw: bytes | None = None):
    return request(r, "POST", "/v1/chat/completions", raw if raw is not None else json.dumps(obj).encode())


def uri(im: Image.Image | str) -> str:
    if isinstance(im, str):
        data = (ASSETS / im).read_bytes()
    else:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def picture(i: int) -> Image.Image:
    """A distinct wide image per i (a 1x3 tile grid + the global tile on the fixture: 64 prompt tokens)."""
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, (16 + i, 96, 3), dtype=np.uint8))


def ask(text: str, *images) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]
            + [{"type": "text", "text": text}]}


def direct(vlm: VLM, messages, **kw) -> str:
    vlm.reset()
    return "".join(vlm.chat(messages, **kw))


def status(r) -> dict:
    return get(r, "/health")[1]


@pytest.fixture(scope="module")
def server(tiny):
    r = start(tiny.bundle, "--slots", "4", "--queue", "16", "--media-dir", str(ASSETS), "--max-images", "4")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def vlm(tiny):
    return VLM.load(tiny.bundle)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


class stream_request:
    """A raw HTTP request on its own socket, closed on exit (the client going away)."""

    def __init__(self, r, body):
        self.r, self.body = r, json.dumps(body).encode()

    def __enter__(self):
        self.s = socket.create_connection(("127.0.0.1", self.r.port), timeout=30)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(self.body)}\r\n\r\n").encode()
        self.s.sendall(head + self.body)
        return self.s

    def __exit__(self, *exc):
        self.s.close()


def read_events(s, n: int) -> bytes:
    buf = b""
    while buf.count(b"data: ") < n:
        data = s.recv(65536)
        assert data, buf
        buf += data
    return buf


def wait_cancelled(r, before: dict, n: int = 1) -> None:
    for _ in range(200):  # bounded: 20 s
        if status(r).get("cancelled", 0) - before.get("cancelled", 0) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no cancellation: {status(r)}")


def wait_idle(r) -> dict:
    for _ in range(200):  # bounded: 20 s
        st = status(r)
        if st["busy"] == 0 and st["queued"] == 0:
            return st
        time.sleep(0.1)
    raise AssertionError(f"the server stays busy: {st}")


LONG = {"messages": [TEXT], "stream": True, "ignore_eos": True, "max_tokens": 1000}  # ~300 tokens: to the context
HOLDER = {"messages": [{"role": "user", "content": HOLD}], "stream": True, "ignore_eos": True, "max_tokens": 1000}


def busy_slots(r, n: int):
    """n holder streams (hold_slots) holding n slots, each seen generating; each holds its slot until closed."""
    socks = [stream_request(r, HOLDER) for _ in range(n)]
    for s in socks:
        read_events(s.__enter__(), 2)
    return socks
