"""`vlmrt serve`'s chat page in Debian's headless Chromium (through Playwright, never `playwright install`): a
question with an image and its streamed answer, the stop button cancelling on the server; and the command line: its
one-line errors, and `vlmrt serve` on the offline demo model in a subprocess."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from conftest import ASSETS
from serve_client import (  # noqa: F401  (fixtures: tiny, server, vlm)
    CHROMIUM, CHROMIUM_ARGS, ask, busy_slots, direct, openai, server, status, tiny, uri, vlm, wait_cancelled,
    wait_idle)
from vlmrt import cli
from vlmrt.runtime.vlm import VLM


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
                for _ in range(400):  # bounded: 20 s (the holders keep every slot busy until they are closed)
                    if status(server)["queued"]:
                        break
                    time.sleep(0.05)
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
    assert (cancelled, completed) == (5, 0)  # the page's question and the four holders


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


@pytest.mark.parametrize("flag, value", [("--max-body-mb", "nan"), ("--max-body-mb", "inf"), ("--image-cache-mb", "nan")])
def test_cli_sizes_that_are_not_finite(tiny, capsys, flag, value):
    """Were an OverflowError traceback (inf) and 'cannot convert float NaN to integer'."""
    assert cli.main(["serve", str(tiny.bundle), flag, value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vlmrt: error: --slots") and "finite numbers" in err[0], err


def test_cli_serves_the_demo_model(demo_model):
    root, bundle = demo_model
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
