"""`vlmrt serve` over real HTTP on loopback: the openai client (streaming and not, several images, multi-turn), raw
malformed requests and their JSON errors, 16 concurrent clients against their solo answers, disconnects that free
their slot, the chat page in Debian's headless Chromium, the CLI with the demo model. Answers are compared with VLM.chat
on the same bundle (the tiny random fixture: its text is noise, but exact)."""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from conftest import ASSETS, CASES, exported

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from vlmrt import cli  # noqa: E402
from vlmrt.runtime.pipeline import VLM  # noqa: E402
from vlmrt.serve.command import Running, add_parser, build  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start(bundle, *args) -> Running:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    a = ap.parse_args(["serve", str(bundle), *args])
    r = Running(build(a, str(bundle)))
    for _ in range(600):  # bounded: 60 s
        if get(r, "/health")[0] == 200:
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return exported(CASES[0], tmp_path_factory)


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


def status(r) -> dict:
    return get(r, "/health")[1]


# ------------------------------------------------------------------------- the openai client


def test_openai_client_plain_and_streamed(client, vlm):
    messages = [ask("What is in the picture?", uri(picture(1)))]
    want = direct(vlm, messages, max_new_tokens=24)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.choices[0].finish_reason == ("length" if vlm.result.stats.stop_reason == "length" else "stop")
    assert out.usage.prompt_tokens == vlm.result.stats.prompt_tokens
    assert out.usage.completion_tokens == vlm.result.stats.generated_tokens
    t = out.model_extra["vlmrt"]
    assert t["ttft_s"] > 0 and t["prefill_tokens_per_s"] > 0 and t["images"] == 1 and "reused_prompt_tokens" in t

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one piece
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == out.choices[0].finish_reason
    assert finish[0].model_extra["vlmrt"]["ttft_s"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_several_images_then_a_follow_up_reuses_the_slot(client, vlm, server):
    a, b = uri(picture(2)), uri(picture(3))
    messages = [{"role": "system", "content": "Answer briefly."}, ask("Compare the two pictures.", a, b)]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=["\n\n"])
    assert first.choices[0].message.content == direct(vlm, messages, max_new_tokens=12, stop=["\n\n"])
    assert first.model_extra["vlmrt"]["images"] == 2
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, ask("And the first one?")]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stop=["\n\n"])
    assert second.choices[0].message.content == direct(vlm, messages, max_new_tokens=12, stop=["\n\n"])
    t = second.model_extra["vlmrt"]
    assert t["slot"] == first.model_extra["vlmrt"]["slot"]  # the slot holding the conversation
    assert t["reused_prompt_tokens"] > 100 and t["images_cached"] == 2
    assert second.usage.prompt_tokens_details.cached_tokens == t["reused_prompt_tokens"]


def test_media_folder_paths(server, vlm):
    status_, body, _ = post(server, {"messages": [ask("What is this?", "camera.png")], "max_tokens": 8})
    assert status_ == 200
    assert body["choices"][0]["message"]["content"] == direct(vlm, [ask("What is this?", str(ASSETS / "camera.png"))],
                                                              max_new_tokens=8)
    status_, body, _ = post(server, {"messages": [ask("?", "../conftest.py")]})
    assert status_ == 400 and "outside the media folder" in body["error"]["message"]


# ------------------------------------------------------------------------- errors

TEXT = {"role": "user", "content": "hi"}
BAD = [
    ("malformed JSON", b'{"messages": [', 400, "invalid_request_error", "invalid_json"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error", "invalid_request"),
    ("no messages", {"model": "x"}, 400, "invalid_request_error", "invalid_request"),
    ("bad base64", {"messages": [ask("?", "data:image/png;base64,@@not base64@@")]}, 400, "invalid_request_error",
     "invalid_image"),
    ("not an image", {"messages": [ask("?", "data:image/png;base64," + base64.b64encode(b"hello, world").decode())]},
     400, "invalid_request_error", "invalid_image"),
    ("unknown part", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "invalid_request_error", "invalid_content_part"),
    ("image_url without url", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     400, "invalid_request_error", "invalid_content_part"),
    ("too many images", {"messages": [ask("?", *[uri(picture(0))] * 5)]}, 400, "invalid_request_error",
     "too_many_images"),
    ("unknown role", {"messages": [{"role": "tool", "content": "x"}]}, 400, "invalid_request_error", "invalid_request"),
    ("last turn not the user's", {"messages": [TEXT, {"role": "assistant", "content": "x"}]}, 400,
     "invalid_request_error", "invalid_request"),
    ("n = 2", {"messages": [TEXT], "n": 2}, 400, "invalid_request_error", "invalid_parameter"),
    ("temperature", {"messages": [TEXT], "temperature": 3}, 400, "invalid_request_error", "invalid_parameter"),
    ("top_p", {"messages": [TEXT], "top_p": 0}, 400, "invalid_request_error", "invalid_parameter"),
    ("max_tokens", {"messages": [TEXT], "max_tokens": 0}, 400, "invalid_request_error", "invalid_parameter"),
    ("stop", {"messages": [TEXT], "stop": [1]}, 400, "invalid_request_error", "invalid_parameter"),
    ("file URL", {"messages": [ask("?", "file:///etc/passwd")]}, 400, "invalid_request_error", "invalid_image"),
]


@pytest.mark.parametrize("name,body,code,etype,ecode", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_json_error(server, name, body, code, etype, ecode):
    status_, out, _ = post(server, None if isinstance(body, bytes) else body, body if isinstance(body, bytes) else None)
    assert status_ == code, out
    err = out["error"]
    assert (err["type"], err["code"]) == (etype, ecode) and isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context(server, stream):
    status_, out, _ = post(server, {"messages": [{"role": "user", "content": "word " * 400}], "stream": stream})
    assert status_ == 400
    err = out["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 320 and err["n_prompt_tokens"] > 320


def test_routes_health_models(server):
    code, out, _ = get(server, "/nope")
    assert code == 404 and out["error"]["code"] == "not_found"
    code, out, headers = get(server, "/v1/chat/completions")
    assert code == 405 and out["error"]["code"] == "method_not_allowed" and "POST" in headers["allow"]
    code, out, _ = request(server, "DELETE", "/health")
    assert code == 405
    code, out, _ = get(server, "/health")
    assert code == 200 and out["status"] == "ok" and out["slots"] == 4
    code, out, _ = get(server, "/v1/models")
    assert code == 200 and out["object"] == "list" and out["data"][0]["id"] == "bundle"
    assert out["data"][0]["meta"]["max_context"] == 320
    code, page, _ = get(server, "/")
    assert code == 200 and b"/v1/chat/completions" in page and b"http" not in page.replace(b"http-equiv", b"")


@pytest.fixture(scope="module")
def small(tiny):
    r = start(tiny.bundle, "--slots", "1", "--queue", "0", "--max-body-mb", "0.01")
    yield r
    r.stop()


def test_body_limit_queue_full_and_bugs(small, monkeypatch):
    code, out, _ = post(small, None, json.dumps({"messages": [TEXT], "pad": "x" * 50_000}).encode())
    assert code == 413 and out["error"]["code"] == "request_too_large"
    with stream_request(small, {"messages": [TEXT], "stream": True, "ignore_eos": True, "max_tokens": 1000}) as s:
        read_events(s, 2)  # the one slot is generating
        code, out, _ = post(small, {"messages": [TEXT], "max_tokens": 2})
        assert code == 503 and out["error"]["code"] == "queue_full" and out["error"]["type"] == "unavailable_error"
    wait_idle(small)

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(small.app.state.vlmrt.scheduler.slots[0].vlm, "chat", boom)
    code, out, _ = post(small, {"messages": [TEXT]})
    assert code == 500 and out["error"] == {"message": "internal server error (logged by the server)",
                                            "type": "server_error", "code": "internal_error"}


def test_health_while_loading(tiny):
    from vlmrt.runtime.bundle import Bundle
    from vlmrt.serve.app import Config, create_app
    from vlmrt.serve.scheduler import Scheduler

    go = threading.Event()

    def load():
        assert go.wait(30)
        return Scheduler(Bundle.open(tiny.bundle), 1, 1)

    r = Running(create_app(load, Config("tiny")))
    try:
        for _ in range(100):
            code, out, _ = get(r, "/health")
            if code is not None:
                break
            time.sleep(0.05)
        assert code == 503 and out["status"] == "loading"
        code, out, _ = post(r, {"messages": [TEXT]})
        assert code == 503 and out["error"]["code"] == "loading"
        go.set()
        for _ in range(300):
            if get(r, "/health")[0] == 200:
                break
            time.sleep(0.1)
        assert get(r, "/health")[0] == 200
    finally:
        go.set()
        r.stop()


# ------------------------------------------------------------------------- concurrency and disconnects


def test_16_concurrent_clients_get_their_solo_answers(server, vlm):
    def one(i):
        body = {"messages": [ask(f"Describe picture {i}.", uri(picture(4 + i)))], "temperature": 0.9, "seed": 1000 + i,
                "max_tokens": 20}
        code, out, _ = post(server, body)
        assert code == 200, out
        return out["choices"][0]["message"]["content"], out["vlmrt"]

    solo = [one(i) for i in range(16)]
    with ThreadPoolExecutor(16) as ex:
        together = list(ex.map(one, range(16)))
    assert [t for t, _ in together] == [t for t, _ in solo]
    assert len({t for t, _ in solo}) == 16
    assert len({v["slot"] for _, v in together}) == 4 and max(v["queue_s"] for _, v in together) > 0
    for i in (0, 7, 15):  # and the solo answers are VLM.chat's
        messages = [ask(f"Describe picture {i}.", uri(picture(4 + i)))]
        assert solo[i][0] == direct(vlm, messages, temperature=0.9, seed=1000 + i, max_new_tokens=20)


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


def busy_slots(r, n: int):
    """n long streams holding n slots, each seen generating."""
    socks = [stream_request(r, LONG) for _ in range(n)]
    for s in socks:
        read_events(s.__enter__(), 2)
    return socks


@pytest.mark.parametrize("where", ["streaming", "waiting for its answer", "queued"])
def test_disconnect_cancels_and_frees_the_slot(server, where):
    before = wait_idle(server)
    holders = busy_slots(server, 4) if where == "queued" else []
    body = {**LONG, "stream": where != "waiting for its answer"}
    with stream_request(server, body) as s:
        if where == "streaming":
            assert b'"role": "assistant"' in read_events(s, 3)  # the role chunk and two content chunks
        else:
            want = (lambda st: st["queued"]) if where == "queued" else (lambda st: st["busy"])
            for _ in range(200):
                if want(status(server)):
                    break
                time.sleep(0.01)
            assert want(status(server))
    wait_cancelled(server, before)  # this request's cancellation: the holders are still generating
    for h in holders:
        h.__exit__()
    after = wait_idle(server)
    cancelled, completed = (after.get(k, 0) - before.get(k, 0) for k in ("cancelled", "completed"))
    assert cancelled >= 1 and cancelled + completed == 1 + len(holders)  # a holder may have reached the context
    if not holders:
        assert completed == 0
    code, out, _ = post(server, {"messages": [TEXT], "max_tokens": 3})  # and the server answers on
    assert code == 200 and out["usage"]["completion_tokens"] <= 3


# ------------------------------------------------------------------------- the chat page, the CLI


def test_chat_page_in_headless_chromium(server, vlm, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (scripts/setup test installs Debian's chromium)")
    messages = [ask("What is in the picture?", uri("camera.png"))]
    want = direct(vlm, messages, max_new_tokens=40)
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_ARGS)
        try:
            page = ctx.new_page()
            page.goto(server.url + "/")
            page.fill("#maxtok", "40")
            page.set_input_files("#file", str(ASSETS / "camera.png"))
            page.wait_for_selector("#attached img")
            page.fill("#prompt", "What is in the picture?")
            page.click("#send")
            page.wait_for_selector(".stats", timeout=60_000)
            answer = page.eval_on_selector(".msg.assistant", "e => e.textContent")
            stats = page.inner_text(".stats")
            assert page.query_selector(".msg.user img") is not None
        finally:
            ctx.close()
    assert answer == want
    assert "prompt tokens" in stats and "first token" in stats and "decode" in stats


def test_chat_page_stop_button_cancels(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    before = wait_idle(server)
    holders = []
    try:
        with sync_api.sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                       headless=True, args=CHROMIUM_ARGS)
            try:
                page = ctx.new_page()
                page.goto(server.url + "/")
                page.fill("#prompt", "Hello?")
                holders = busy_slots(server, 4)  # the page's question waits for a slot: stopped while unfinished
                page.click("#send")
                page.wait_for_function("() => !document.getElementById('stop').disabled")
                for _ in range(200):
                    if status(server)["queued"]:
                        break
                    time.sleep(0.01)
                assert status(server)["queued"] == 1
                page.click("#stop")
                page.wait_for_function("() => document.querySelector('.msg.assistant').textContent.includes('[stopped]')")
                assert not page.is_disabled("#send")
                wait_cancelled(server, before)  # the page's request, dropped from the queue
            finally:
                ctx.close()
    finally:
        for h in holders:
            h.__exit__()
    after = wait_idle(server)
    cancelled, completed = (after.get(k, 0) - before.get(k, 0) for k in ("cancelled", "completed"))
    assert cancelled >= 1 and cancelled + completed == 5


def test_cli_errors_are_one_line(tiny, capsys, tmp_path):
    assert cli.main(["serve", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlmrt: error:")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.main(["serve", str(tiny.bundle), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vlmrt: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert cli.main(["serve", str(tiny.bundle), "--slots", "0"]) == 1
    assert capsys.readouterr().err.startswith("vlmrt: error: --slots")


def test_cli_serves_the_demo_model(demo_cache):
    root, bundle = demo_cache
    p = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "serve", "--port", "0", "--slots", "2", "--mode", "kv",
                          "--log-level", "warning"],
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "VLMRT_CACHE": str(root)})
    try:
        line = p.stderr.readline()
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/", line)
        assert m, line
        c = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(600):
            try:
                c.models.list()
                code = http.client.HTTPConnection(m.group(1)[7:].split(":")[0], int(m.group(1).rsplit(":", 1)[1]))
                code.request("GET", "/health")
                if code.getresponse().status == 200:
                    break
            except (openai.APIError, OSError):
                pass
            time.sleep(0.1)
        messages = [ask("What color is the shape?", uri(str(ASSETS.parent.parent / "src/vlmrt/demo/data/shape.png")))]
        out = c.chat.completions.create(model="easyvqa", messages=messages)
        vlm = VLM.load(bundle)
        answer = out.choices[0].message.content
        assert answer == direct(vlm, messages, mode="kv") and answer.strip() == "green" and out.choices[0].finish_reason == "stop"
        messages += [{"role": "assistant", "content": answer}, ask("What shape is it?")]
        follow = c.chat.completions.create(model="easyvqa", messages=messages)
        assert follow.choices[0].message.content == direct(vlm, messages, mode="kv")
        t = follow.model_extra["vlmrt"]  # kv mode: every row of the first turn is kept (hybrid: full 32-token blocks)
        assert t["reused_prompt_tokens"] >= out.usage.prompt_tokens and t["images_cached"] == 1
    finally:
        p.terminate()
        p.wait(30)
