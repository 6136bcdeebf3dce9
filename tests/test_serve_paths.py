"""`vlmrt serve` where its paths meet, over real HTTP on loopback, every answer compared with a fresh VLM.chat of the
same conversation: a client that goes away mid-answer or mid-prefill and then a follow-up on that slot, concurrent
multi-turn conversations with cancels mixed in, an error after the first streamed chunk, and a stop string that ends
a streamed answer. The server's sessions are wrapped (Gate) so that a prefill can be held or a decoder call fail at a
chosen point: by construction, not by the clock."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from session_hooks import DecoderCallHook
from serve_client import (  # noqa: F401  (fixtures: tiny, vlm)
    HOLDER, ask, busy_slots, direct, get, hold_slots, openai, picture, post, read_events, status, stream_request, tiny,
    uri, vlm, wait_cancelled, wait_idle)
from vlmrt.runtime.bundle import Bundle
from vlmrt.serve.app import Config, create_app
from vlmrt.serve.command import Running
from vlmrt.serve.scheduler import Scheduler


class Gate(DecoderCallHook):
    """A bundle's sessions whose decoder graph calls can be held or made to fail at the n-th call from now: hold(n)
    stops the n-th call until release() (entered is set when it is reached); fail(n) makes it raise."""

    def __init__(self, sessions):
        super().__init__(sessions)
        self.left, self.action = None, None
        self.entered, self.go = threading.Event(), threading.Event()

    def hold(self, n: int) -> None:
        self.entered.clear()
        self.go.clear()
        self.left, self.action = n, "hold"

    def fail(self, n: int) -> None:
        self.left, self.action = n, "fail"

    def release(self) -> None:
        self.go.set()

    def tick(self) -> None:
        if self.left is None:
            return
        self.left -= 1
        if self.left:
            return
        self.left = None
        if self.action == "fail":
            raise RuntimeError("an injected decoder failure")
        self.entered.set()
        assert self.go.wait(60), "the test never released the held call"


def gated_server(bundle, slots: int):
    b = Bundle.open(bundle)
    gate = b.sessions = Gate(b.sessions)
    r = Running(create_app(lambda: Scheduler(b, slots, 16), Config("tiny")))
    for _ in range(600):  # bounded: 60 s
        if get(r, "/health")[0] == 200:
            hold_slots(r)
            return r, gate
        time.sleep(0.1)
    r.stop()
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def one_slot(tiny):
    r, gate = gated_server(tiny.bundle, 1)
    yield r, gate
    gate.release()
    r.stop()


@pytest.fixture(scope="module")
def two_slots(tiny):
    r, gate = gated_server(tiny.bundle, 2)
    yield r
    gate.release()
    r.stop()


def wait_for(cond, what="the watcher to see the client go") -> None:
    for _ in range(400):  # bounded: 20 s
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"waited 20 s for {what}")


def answer(r, messages, **kw) -> dict:
    code, out, _ = post(r, {"messages": messages, **kw})
    assert code == 200, out
    return out


def content(out: dict) -> str:
    return out["choices"][0]["message"]["content"]


def sse(raw: bytes) -> list:
    """The data events of a raw HTTP/1.1 SSE response (chunked transfer decoded): JSON objects, or "[DONE]"."""
    head, _, body = raw.partition(b"\r\n\r\n")
    data, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        data, rest = data + rest[:n], rest[n + 2:]
    else:
        raise AssertionError("the chunked response did not end with its last chunk")
    events = [e[len(b"data: "):] for e in data.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def read_all(s) -> bytes:
    buf = b""
    while True:
        d = s.recv(65536)
        if not d:
            return buf
        buf += d
        if buf.endswith(b"\r\n0\r\n\r\n"):
            return buf


# ------------------------------------------------------------------------- cancel, then follow up


def test_client_gone_mid_answer_then_follow_ups_on_its_slot_equal_fresh_runs(one_slot, vlm):
    """The answer is held at its 6th decode step (by the Gate: it cannot finish first) while its client goes away."""
    r, gate = one_slot
    kw = dict(max_new_tokens=30, ignore_eos=True)
    first = [ask("Describe the picture.", uri(picture(21)))]
    direct(vlm, first, **kw)
    prefill_calls = -(-vlm.result.stats.prompt_tokens // 8)  # hybrid: blocks of 8
    before = wait_idle(r)
    gate.hold(prefill_calls + 6)
    try:
        with stream_request(r, {"messages": first, "stream": True, "max_tokens": 30, "ignore_eos": True}) as s:
            got = read_events(s, 3)  # the role chunk and two pieces
            assert gate.entered.wait(60)
            job = r.app.state.vlmrt.scheduler.slots[0].job
        wait_for(lambda: job.cancelled)  # the client has gone: the watcher cancelled its job
    finally:
        gate.release()
    wait_cancelled(r, before)
    partial = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_partial(got))
    assert partial and direct(vlm, first, **kw).startswith(partial)
    for messages in (first, first + [{"role": "assistant", "content": partial}, ask("What else?")]):
        out = answer(r, messages, max_tokens=30, ignore_eos=True)
        assert content(out) == direct(vlm, messages, **kw)
        assert out["vlmrt"]["reused_prompt_tokens"] > 0  # the slot's rows from the cancelled answer were reused


def sse_partial(raw: bytes) -> list[dict]:
    """The complete JSON data events of a stream cut short (chunk framing skipped)."""
    out = []
    for part in raw.split(b"data: ")[1:]:
        line = part.split(b"\n\n")[0]
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_client_gone_mid_prefill_then_follow_ups_equal_fresh_runs(one_slot, vlm):
    """The slot holds a first conversation; a long two-image prompt of another one is held in the middle of its
    prefill while its client goes away; then the first conversation's follow-up, and the long prompt again, are
    fresh runs' answers."""
    r, gate = one_slot
    kw = dict(max_new_tokens=10, ignore_eos=True)
    first = [ask("What is in the picture?", uri(picture(22)))]
    a = content(answer(r, first, max_tokens=10, ignore_eos=True))
    assert a == direct(vlm, first, **kw)
    long = [ask("Compare these two pictures in detail, please.", uri(picture(23)), uri(picture(24)))]
    direct(vlm, long, max_new_tokens=1)
    n = vlm.result.stats.prompt_tokens
    assert n > 100
    before = wait_idle(r)
    gate.hold(n // 8 // 2)  # (hybrid prefill: blocks of 8) the middle of it
    try:
        with stream_request(r, {"messages": long, "stream": True, "max_tokens": 10}):
            assert gate.entered.wait(60), "the prefill never reached the held call"
            job = r.app.state.vlmrt.scheduler.slots[0].job
        wait_for(lambda: job.cancelled)
    finally:
        gate.release()
    wait_cancelled(r, before)
    follow = first + [{"role": "assistant", "content": a}, ask("And its colours?")]
    for messages in (follow, long):
        assert content(answer(r, messages, max_tokens=10, ignore_eos=True)) == direct(vlm, messages, **kw)


# ------------------------------------------------------------------------- concurrency with cancels mixed in


def test_concurrent_multi_turn_conversations_with_cancels(two_slots, vlm):
    """Five 3-turn conversations (greedy and sampled, images on some turns) at once on 2 slots, so that follow-ups
    find their slot busy or taken, while other clients go away mid-stream or while queued: every surviving answer is
    the answer of its conversation run alone, and the server ends idle with the cancels counted."""
    r = two_slots
    before = wait_idle(r)
    rnd = random.Random(5)

    def conversation(k: int):
        sampling = {"temperature": 0.9, "seed": 40 + k} if k % 2 else {}
        messages, got = [], []
        for turn in range(3):
            parts = [uri(picture(30 + k))] if turn == k % 2 else []  # one image, on the first or second turn
            messages = messages + [ask(f"Conversation {k}, question {turn}.", *parts)]
            out = answer(r, messages, max_tokens=10, **sampling)
            got.append((list(messages), sampling, content(out)))
            messages = messages + [{"role": "assistant", "content": content(out)}]
            time.sleep(rnd.random() * 0.05)
        return got

    def quitter(k: int):
        """A client that goes away mid-answer (odd k) or as soon as it has sent its request (queued, or in its
        prefill); its request holds its slot until then (a HOLD turn after a turn with an image)."""
        body = {**HOLDER, "messages": [ask(f"A client that leaves, {k}.", uri(picture(50 + k))),
                                       {"role": "assistant", "content": "Yes."}, *HOLDER["messages"]]}
        time.sleep(rnd.random() * 0.3)
        with stream_request(r, body) as s:
            if k % 2:
                read_events(s, 2)

    with ThreadPoolExecutor(9) as ex:
        convs = [ex.submit(conversation, k) for k in range(5)]
        quits = [ex.submit(quitter, k) for k in range(4)]
        for f in quits:
            f.result()
        results = [f.result() for f in convs]
    after = wait_idle(r)
    assert [after.get(k, 0) - before.get(k, 0) for k in ("completed", "cancelled", "failed")] == [15, 4, 0]
    for turns in results:
        for messages, sampling, text in turns:
            kw = {"temperature": sampling["temperature"], "seed": sampling["seed"]} if sampling else {}
            assert text == direct(vlm, messages, max_new_tokens=10, **kw), messages[-1]


def test_a_new_conversation_sharing_the_system_message_keeps_off_a_live_conversations_slot(two_slots):
    """Conversations that share a system message (a deployment's system prompt): a new one does not take the slot of
    one between its turns (common to both: the system message alone), so that one's follow-up finds its rows. Fails
    on main 9148cae: the new conversation took the slot sharing the most leading messages (its system message), and
    the follow-up prefilled cold (the Ray routing test's flake: a replica's conversations thrashed one slot)."""
    r = two_slots
    wait_idle(r)
    system = {"role": "system", "content": f"You describe pictures briefly ({random.random()})."}
    first = [system, ask("What is in this picture?", uri(picture(61)))]
    a = answer(r, first, max_tokens=6, ignore_eos=True)
    answer(r, [system, ask("Name a colour.")], max_tokens=6, ignore_eos=True)  # a new conversation, between A's turns
    follow = first + [{"role": "assistant", "content": content(a)}, ask("And the shapes?")]
    again = answer(r, follow, max_tokens=6, ignore_eos=True)
    # its first prompt's rows (less its last few: the generation prompt, taken again with the answer), not the
    # system message's alone
    assert again["vlmrt"]["reused_prompt_tokens"] >= a["usage"]["prompt_tokens"] - 8, (a["usage"], again["vlmrt"])


# ------------------------------------------------------------------------- streamed ends: an error, a stop string


def test_an_error_after_the_first_streamed_chunk_ends_the_stream_well_formed(one_slot, vlm):
    """A decoder call that fails after some pieces have streamed: the client has the 200 stream's role chunk and
    content chunks, then one error event (the 500's JSON error body: server_error / internal_error), and a
    properly terminated response (no finish chunk, no [DONE]: the answer did not finish); the openai client raises
    APIError. The slot is free again and its next answer is a fresh run's."""
    r, gate = one_slot
    before = wait_idle(r)
    messages = [ask("Tell me a long story.")]
    gate.fail(6)  # prefill (a few blocks) + some decode steps
    with stream_request(r, {"messages": messages, "stream": True, "max_tokens": 40, "ignore_eos": True}) as s:
        raw = read_all(s)
    assert raw.startswith(b"HTTP/1.1 200") and b"text/event-stream" in raw.split(b"\r\n\r\n")[0]
    events = sse(raw)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    pieces = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert pieces and all(pieces)
    assert events[-1] == {"error": {"message": "internal server error (logged by the server)", "type": "server_error",
                                    "code": "internal_error"}}
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
    assert direct(vlm, messages, max_new_tokens=40, ignore_eos=True).startswith("".join(pieces))
    after = wait_idle(r)
    assert after.get("failed", 0) - before.get("failed", 0) == 1

    gate.fail(6)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="internal server error"):
        for _ in c.chat.completions.create(model="tiny", messages=messages, max_tokens=40, stream=True,
                                           extra_body={"ignore_eos": True}):
            pass
    wait_idle(r)
    for m in (messages, [ask("Another question.", uri(picture(25)))]):
        assert content(answer(r, m, max_tokens=12, ignore_eos=True)) == direct(vlm, m, max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("at", [5, 9])
def test_a_stop_string_ends_a_streamed_answer(one_slot, vlm, at):
    """A stop string spanning two tokens of the answer: the stream's pieces add up to the text before it (the piece
    that began it was held back and never sent), finish_reason is "stop", and the plain request agrees."""
    r, _ = one_slot
    messages = [ask("What is in the picture?", uri(picture(26)))]
    direct(vlm, messages, max_new_tokens=30, ignore_eos=True)
    ids, tok = vlm.result.token_ids, vlm.bundle.tokenizer
    stop = tok.decode(ids[at : at + 2], skip_special_tokens=True)
    text = tok.decode(ids, skip_special_tokens=True)
    assert stop.strip() and text.find(stop) == len(tok.decode(ids[:at], skip_special_tokens=True)), stop
    want = direct(vlm, messages, max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert vlm.result.stats.stop_reason == "stop" and text.startswith(want + stop)
    body = {"messages": messages, "stream": True, "max_tokens": 30, "ignore_eos": True, "stop": [stop]}
    with stream_request(r, body) as s:
        events = sse(read_all(s))
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[1:-1]]
    streamed = "".join(c["delta"].get("content", "") for c in chunks)
    assert streamed == want  # not a character of the stop string (held back while it might begin one) was sent
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["stop"]
    out = answer(r, messages, max_tokens=30, ignore_eos=True, stop=[stop])
    assert content(out) == want and out["choices"][0]["finish_reason"] == "stop"
