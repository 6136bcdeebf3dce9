"""`vlmrt serve` over real HTTP on loopback: the openai client (streaming and not, several images, multi-turn), raw
malformed requests and their JSON errors, 413 / 503 / 500, /health while loading, 16 concurrent clients against their
solo answers, disconnects that free their slot. Answers are compared with VLM.chat on the same bundle (the tiny random
fixture: its text is noise, but exact). The chat page and the CLI: test_serve_page.py."""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ASSETS
from serve_client import (  # noqa: F401  (fixtures: tiny, server, vlm, client)
    openai,
    HOLDER, TEXT, Running, ask, busy_slots, client, direct, get, picture, post, read_events, request, server, start,
    status, stream_request, tiny, uri, vlm, wait_cancelled, wait_idle)
from vlmrt.runtime.decode import lookahead


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
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error", "invalid_request"),
    ("a tool message without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "invalid_request_error", "invalid_request"),
    ("last turn not the user's", {"messages": [TEXT, {"role": "assistant", "content": "x"}]}, 400,
     "invalid_request_error", "invalid_request"),
    ("n = 2", {"messages": [TEXT], "n": 2}, 400, "invalid_request_error", "invalid_parameter"),
    ("temperature", {"messages": [TEXT], "temperature": 3}, 400, "invalid_request_error", "invalid_parameter"),
    ("top_p", {"messages": [TEXT], "top_p": 0}, 400, "invalid_request_error", "invalid_parameter"),
    ("max_tokens", {"messages": [TEXT], "max_tokens": 0}, 400, "invalid_request_error", "invalid_parameter"),
    ("stop", {"messages": [TEXT], "stop": [1]}, 400, "invalid_request_error", "invalid_parameter"),
    ("file URL", {"messages": [ask("?", "file:///etc/passwd")]}, 400, "invalid_request_error", "invalid_image"),
    ("JSON nested too deeply", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_request_error",
     "invalid_json"),
    ("a 5000-digit integer", b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1' + b"0" * 5000 + b"}", 400,
     "invalid_request_error", "invalid_json"),
    ("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "invalid_request_error", "invalid_parameter"),
    ("temperature too large for a float", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1'
     + b"0" * 400 + b"}", 400, "invalid_request_error", "invalid_parameter"),
    ("a lone surrogate in the text", b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}', 400,
     "invalid_request_error", "invalid_request"),
    ("a lone surrogate in an image url", {"messages": [ask("?", "\ud800.png")]}, 400, "invalid_request_error",
     "invalid_image"),
    ("a malformed URL", {"messages": [ask("?", "https://[::1/x.png")]}, 400, "invalid_request_error", "invalid_image"),
    ("top_logprobs over 20", {"messages": [TEXT], "logprobs": True, "top_logprobs": 21}, 400, "invalid_request_error",
     "invalid_parameter"),
    ("a response_format of no known type", {"messages": [TEXT], "response_format": {"type": "xml"}}, 400,
     "invalid_request_error", "invalid_parameter"),
    ("tool_choice naming no tool", {"messages": [TEXT], "tools": [{"type": "function", "function": {"name": "f"}}],
                                    "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "invalid_request_error", "invalid_parameter"),
    ("a penalty", {"messages": [TEXT], "frequency_penalty": 0.5}, 400, "invalid_request_error", "unsupported_parameter"),
    ("logit_bias", {"messages": [TEXT], "logit_bias": {"5": 10}}, 400, "invalid_request_error", "unsupported_parameter"),
    ("include_usage not a boolean", {"messages": [TEXT], "stream": True, "stream_options": {"include_usage": "no"}},
     400, "invalid_request_error", "invalid_parameter"),
    ("empty content list", {"messages": [{"role": "user", "content": []}]}, 400, "invalid_request_error",
     "invalid_request"),
    ("negative seed", {"messages": [TEXT], "seed": -1}, 400, "invalid_request_error", "invalid_parameter"),
]


def test_fields_that_ask_for_the_default_are_accepted(server, vlm):
    """What clients send along (LangChain's zero penalties, logprobs false, a text response_format, no tools, user,
    metadata, an unknown field) changes nothing: the answer is the plain request's."""
    harmless = {"model": "any", "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
                "modalities": ["text"], "stream_options": {"include_usage": True}, "some_extension": [1, 2]}
    messages = [ask("What is in the picture?", uri(picture(9)))]
    code, out, _ = post(server, {"messages": messages, "max_tokens": 6, **harmless})
    assert code == 200, out
    assert out["choices"][0]["message"]["content"] == direct(vlm, messages, max_new_tokens=6)
    assert out["choices"][0]["logprobs"] is None


def test_lookahead_server_answers_as_plain_decoding(tiny, vlm, monkeypatch):
    """`vlmrt serve --lookahead 4`: greedy answers (plain and streamed, with an image, and a follow-up) equal plain
    decoding's in process, and drafts were verified (the timings say how many; on this random fixture few are, and
    none is accepted: test_lookahead*.py cover acceptance). The random fixture's answers repeat no 3-gram, so 2-grams
    are looked up too (as test_lookahead_bundles does) for drafts to be verified at all."""
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 4)
    r = start(tiny.bundle, "--slots", "2", "--lookahead", "4")
    try:
        c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
        words = "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta"
        drafted = 0
        for messages in ([ask(f"Repeat: {words}")], [ask(f"List: {words}", uri(picture(4)))]):
            want = direct(vlm, messages, max_new_tokens=80, ignore_eos=True)
            out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=80,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].message.content == want
            t = out.model_extra["vlmrt"]
            assert 0 <= t["accepted_tokens"] <= t["drafted_tokens"]
            drafted += t["drafted_tokens"]
            streamed = c.chat.completions.create(model="tiny", messages=messages, max_tokens=80, stream=True,
                                                 extra_body={"ignore_eos": True})
            assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want
            messages = messages + [{"role": "assistant", "content": want}, ask(f"Again: {words}")]
            out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=80,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].message.content == direct(vlm, messages, max_new_tokens=80, ignore_eos=True)
        assert drafted > 0
        # sampling does not draft
        out = c.chat.completions.create(model="tiny", messages=[ask(f"Repeat: {words}")], max_tokens=8,
                                        temperature=0.8, seed=3)
        assert out.model_extra["vlmrt"]["drafted_tokens"] == 0
    finally:
        r.stop()


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
    with stream_request(small, HOLDER) as s:
        read_events(s, 2)  # the one slot is held
        code, out, headers = post(small, {"messages": [TEXT], "max_tokens": 2})
        assert code == 503 and out["error"]["code"] == "queue_full" and out["error"]["type"] == "unavailable_error"
        assert headers["retry-after"] == "1"  # the openai client waits that long before its retry
    wait_idle(small)

    def boom(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(small.app.state.vlmrt.scheduler.slots[0].vlm, "chat_answer", boom)
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


@pytest.mark.parametrize("where", ["streaming", "waiting for its answer", "queued"])
def test_disconnect_cancels_and_frees_the_slot(server, where):
    before = wait_idle(server)
    holders = busy_slots(server, 4) if where == "queued" else []
    body = {**HOLDER, "stream": where != "waiting for its answer"}  # a request that only its client's going ends
    with stream_request(server, body) as s:
        if where == "streaming":
            assert b'"role": "assistant"' in read_events(s, 3)  # the role chunk and two content chunks
        else:
            want = (lambda st: st["queued"]) if where == "queued" else (lambda st: st["busy"])
            for _ in range(400):  # bounded: 20 s (the holders keep every slot busy until they are closed)
                if want(status(server)):
                    break
                time.sleep(0.05)
            assert want(status(server))
    wait_cancelled(server, before)  # this request's cancellation: the holders are still generating
    for h in holders:
        h.__exit__()
    after = wait_idle(server)
    cancelled, completed = (after.get(k, 0) - before.get(k, 0) for k in ("cancelled", "completed"))
    assert (cancelled, completed) == (1 + len(holders), 0)
    code, out, _ = post(server, {"messages": [TEXT], "max_tokens": 3})  # and the server answers on
    assert code == 200 and out["usage"]["completion_tokens"] <= 3
