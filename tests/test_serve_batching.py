"""`vlmrt serve` with continuous batching (serve/scheduler.py over runtime/answers.py and runtime/decode/scheduler.py) on the tiny fixture bundle:
concurrent requests decode together and each gets its solo answer; a request that fails mid-batch fails alone with
its JSON error while the others' answers do not change; a batched call that raises fails the requests it was to
advance (500) and the server goes on."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest

from cpu_isa import plant_multi_row_rounding
from serve_client import ask, picture, post, start, status, tiny, uri, vlm, wait_idle  # noqa: F401  (fixtures)

FAIL = "fail after three pieces"


@pytest.fixture(scope="module")
def batched(tiny):
    r = start(tiny.bundle, "--slots", "4", "--queue", "16")
    for slot in r.app.state.vlmrt.scheduler.slots:
        v = slot.vlm
        v.chat_answer = functools.partial(_maybe_failing, v.chat_answer)
        v.stream = functools.partial(_fails, v.stream)
    yield r
    r.stop()


def _maybe_failing(chat_answer, messages, **kw):
    a = chat_answer(messages, **kw)
    a.fails = messages[-1]["content"] == FAIL
    return a


def _fails(stream, a, ids):
    """A request whose own answer raises mid-way (a bug in its steps), after its decode steps joined the batch."""
    for piece in stream(a, ids):
        a.pieces = getattr(a, "pieces", 0) + bool(piece)
        if a.fails and a.pieces == 3:
            raise RuntimeError("a bug in this request")
        yield piece


def _bodies(n):
    return [{"messages": [ask(f"Describe picture {i}.", uri(picture(i)))], "max_tokens": 16 + 3 * i,
             "temperature": 0.8 if i % 2 else 0.0, "seed": 100 + i} for i in range(n)]


def _text(resp):
    code, out, _ = resp
    assert code == 200, out
    return out["choices"][0]["message"]["content"]


def test_requests_decode_together_and_failures_stay_alone(batched):
    bodies = _bodies(5)
    solo = [_text(post(batched, b)) for b in bodies]
    before = status(batched)
    assert before["batched"]
    over = {"messages": [{"role": "user", "content": "word " * 400}]}
    fails = {"messages": [{"role": "user", "content": FAIL}], "max_tokens": 40, "ignore_eos": True}
    with ThreadPoolExecutor(7) as ex:
        futures = [ex.submit(post, batched, b) for b in bodies[:2]]
        bad = [ex.submit(post, batched, over), ex.submit(post, batched, fails)]
        futures += [ex.submit(post, batched, b) for b in bodies[2:]]
        together = [_text(f.result()) for f in futures]
        (c1, o1, _), (c2, o2, _) = (f.result() for f in bad)
    assert together == solo
    assert c1 == 400 and o1["error"]["type"] == "exceed_context_size_error"
    assert c2 == 500 and o2["error"]["code"] == "internal_error"
    after = wait_idle(batched)
    assert after["batch_calls"] > before["batch_calls"] and after["batch_widest"] >= 3  # answers decoded together


def test_a_batched_call_that_raises_fails_those_it_advanced(batched, monkeypatch):
    decoder = batched.app.state.vlmrt.scheduler.decoder
    call, calls = decoder.batch_call, {"n": 0}

    def flaky(pending):
        calls["n"] += 1
        if calls["n"] == 4:  # the 4th call
            raise RuntimeError("a bad call")
        return call(pending)

    monkeypatch.setattr(decoder, "batch_call", flaky)
    bodies = _bodies(3)
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda b: post(batched, b), bodies))
    codes = sorted(c for c, _, _ in outs)
    assert 500 in codes and all(c in (200, 500) for c in codes)
    assert all(o["error"]["code"] == "internal_error" for c, o, _ in outs if c == 500)
    monkeypatch.setattr(decoder, "batch_call", call)
    assert _text(post(batched, bodies[0]))  # the server goes on


def test_a_failing_request_leaves_the_others_steps_of_its_round(batched):
    """The failing request holds the last slot, so when it raises, the three before it have already handed their decode
    steps of that round to the batch: those steps still run (the batched call is not cleared with the failure) and
    the three answers are their solo answers."""
    import time

    from serve_client import status

    bodies = [{"messages": [{"role": "user", "content": f"Tell me about the number {i}."}], "max_tokens": 200,
               "ignore_eos": True} for i in range(3)]
    solo = [_text(post(batched, b)) for b in bodies]
    fails = {"messages": [{"role": "user", "content": FAIL}], "max_tokens": 40, "ignore_eos": True}
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(post, batched, b) for b in bodies]
        for _ in range(500):  # bounded: 5 s; the three hold slots 0..2 (the lowest free slot is taken first)
            if status(batched)["busy"] == 3:
                break
            time.sleep(0.01)
        bad = ex.submit(post, batched, fails)  # slot 3
        code, out, _ = bad.result()
        together = [_text(f.result()) for f in futures]
    assert code == 500 and out["error"]["code"] == "internal_error"
    assert together == solo


def test_an_lfm2_bundle_decodes_its_slots_together(tmp_path_factory):
    """An LFM2-VL bundle (conv layers beside GroupQueryAttention, decoder.kind.batched) served with slots: they share
    one scheduler's batched calls, and concurrent requests (an image each, greedy and sampled) get their solo answers."""
    from family_cases import LFM2_CASES, lfm2_exported

    case = next(c for c in LFM2_CASES if c.name == "lfm2-conv-attn-conv-conv-gqa")
    r = start(lfm2_exported(case, tmp_path_factory).bundle, "--slots", "3", "--queue", "8")
    try:
        assert r.app.state.vlmrt.scheduler.decoder.batched
        bodies = _bodies(4)
        solo = [_text(post(r, b)) for b in bodies]
        before = status(r)
        with ThreadPoolExecutor(4) as ex:
            together = [_text(x) for x in ex.map(lambda b: post(r, b), bodies)]
        after = wait_idle(r)
        assert together == solo and before["batched"]
        assert after["batch_calls"] > before["batch_calls"] and after["batch_widest"] >= 2
    finally:
        r.stop()


def test_answers_do_not_depend_on_the_load_where_one_row_calls_round_apart(tiny):
    """A decoder whose one-row calls compute a row apart from its multi-row calls (planted: cpu_isa.py
    MultiRowRounding, as MLAS's int8 kernels do on an AVX2-only CPU): the server's probe at load finds it and every
    batched call runs at least two rows (/health: batch_min_rows 2), so a request's answer sent alone equals its answer
    among others, greedy and seeded. Before, one sent alone ran one-row calls and answered otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        planted = plant_multi_row_rounding(mp, scale=0.1)
        r = start(tiny.bundle, "--slots", "4", "--queue", "8")
    try:
        bodies = [{"messages": [{"role": "user", "content": f"Tell me about the number {i}."}], "max_tokens": 20,
                   "ignore_eos": True, "temperature": 0.8 if i % 2 else 0.0, "seed": 100 + i} for i in range(4)]
        solo = [_text(post(r, b)) for b in bodies]
        before = status(r)
        with ThreadPoolExecutor(4) as ex:
            together = [_text(x) for x in ex.map(lambda b: post(r, b), bodies)]
        after = wait_idle(r)
        assert together == solo
        assert before["batch_min_rows"] == 2 and before["batch_invariant"] and planted[0].calls > 0
        assert after["batch_widest"] >= 2  # they did decode together
    finally:
        r.stop()


def test_no_batch_padding_leaves_a_request_alone_in_one_row_calls(tiny):
    """`--no-batch-padding`: the probe's finding is kept but a request alone runs one-row calls (faster where the
    multi-row path costs more: w4a16), and /health says the answers are no longer independent of the load."""
    with pytest.MonkeyPatch.context() as mp:
        plant_multi_row_rounding(mp, scale=0.1)
        r = start(tiny.bundle, "--slots", "2", "--no-batch-padding")
    try:
        h = status(r)
        assert h["batch_min_rows"] == 1 and h["batch_invariant"] is False
        assert r.app.state.vlmrt.scheduler.decoder.probed["min_rows"] == 2
    finally:
        r.stop()


def test_a_new_conversation_leaves_a_live_one_its_slot(tiny):
    """--slots 2, calls batched: A's first turn, B's, A's follow-up, then a new conversation C takes B's slot (the
    least recently used), not A's, so that A's next follow-up still finds its rows. (On main 62241fa C took the lowest
    free row, A's between its turns: A's follow-up prefilled cold. The routing test of tests/test_serve_ray.py failed
    on it in CI: 12 of 16 follow-ups reused their rows.)"""
    r = start(tiny.bundle, "--slots", "2", "--queue", "4")
    try:
        assert status(r)["batched"]

        def turn(messages: list[dict]) -> dict:
            code, out, _ = post(r, {"messages": messages, "max_tokens": 6})
            assert code == 200, out
            messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And then, {len(messages)}?"}]
            return out["vlmrt"]

        a, b, c = ([ask(f"What is in picture {i}?", uri(picture(40 + i)))] for i in range(3))
        first, other = turn(a), turn(b)
        second = turn(a)
        assert second["slot"] == first["slot"] != other["slot"] and second["reused_prompt_tokens"] > 40
        assert turn(c)["slot"] == other["slot"]
        third = turn(a)
        assert third["slot"] == first["slot"] and third["reused_prompt_tokens"] > second["reused_prompt_tokens"]
    finally:
        r.stop()


def test_a_slot_holds_its_conversation_before_the_answer_is_sent(tiny, monkeypatch):
    """When an answer's "done" event is sent, its slot is already free and holds the conversation: a follow-up sent the
    instant the answer arrives (the scheduler thread descheduled right after sending, as on a loaded machine) finds
    its rows. (On main 81a30ea the slot was freed after the event: such a follow-up found it busy and took an empty
    slot, a cold prefill: the Ray routing test's [33, 1, 171] under load.)"""
    from vlmrt.serve import scheduler as sched

    r = start(tiny.bundle, "--slots", "2", "--queue", "4")
    slots, seen, emit = r.app.state.vlmrt.scheduler.slots, [], sched.Job.emit

    def checked(job, kind, value=None):
        if kind == "done":
            s = slots[value.slot]
            seen.append((s.job is None, s.history[-1][0] if s.history else None))
        emit(job, kind, value)

    monkeypatch.setattr(sched.Job, "emit", checked)
    try:
        code, out, _ = post(r, {"messages": [ask("What is in the picture?", uri(picture(50)))], "max_tokens": 4})
        assert code == 200, out
        assert seen == [(True, "assistant")], seen
    finally:
        r.stop()
