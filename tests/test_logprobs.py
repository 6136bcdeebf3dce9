"""Log probabilities (issue 49 item 3): each answer token's logprob and top_logprobs from the logits row it was
picked from (runtime/decode/logprobs.py), recorded by its Sequence only where it asked; against log_softmax of the
logits the runtime computes (teacher-forced along the answer), against transformers' logits on the same fp32 weights,
through the batched round and lookahead decoding; the tokens' bytes (runtime/prompt/token_bytes.py); and the server's
chat completions (streamed and not) and Responses API in OpenAI's shape through the official SDK, bad input a 400
naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve_client import TEXT, openai, request, start, tiny, vlm  # noqa: F401  (fixtures)
from vlmrt.runtime.answers import AnswerLoop
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.decode import scheduler as scheduler_module
from vlmrt.runtime.decode.logprobs import token_logprobs, top_ids
from vlmrt.runtime.decode.sampler import SamplingConfig
from vlmrt.runtime.prompt.token_bytes import TokenBytes
from vlmrt.runtime.vlm import VLM

PROMPT = "Describe the picture in a few words."
N = 12


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_token_logprobs_is_log_softmax_of_the_row():
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(1000) * 4).astype(np.float32)
    row[[7, 9]] = row.max() + 1  # a tie at the top: the lower id first
    ref = log_softmax(row)
    e = token_logprobs(row, 123, top=20)
    assert e.id == 123 and abs(e.logprob - ref[123]) < 1e-5
    want = sorted(range(1000), key=lambda i: (-row[i], i))[:20]
    assert [t.id for t in e.top] == want and want[:2] == [7, 9]
    assert max(abs(t.logprob - ref[t.id]) for t in e.top) < 1e-5
    assert token_logprobs(row.astype(np.float16), 5).top == []  # top 0: the token's alone; any float dtype
    # the top ids (found among the values over the block maxima's bound) are a sort's, ties and short rows too
    for trial in range(60):
        n, k = int(rng.integers(1, 70000)), int(rng.integers(1, 21))
        y = (rng.standard_normal(n) * 3).astype(np.float32)
        y = np.round(y) if trial % 2 else y  # many ties
        assert list(top_ids(y, k)) == list(np.lexsort((np.arange(n), -y))[:k]), (n, k)  # (a whole sort)
    assert abs(token_logprobs(row.astype(np.float16), 5).logprob - log_softmax(row.astype(np.float16))[5]) < 1e-3


def _teacher_forced(vlm, prompt_ids, ids, mode="hybrid") -> np.ndarray:
    vlm.reset()
    return vlm.row.score(vlm.scheduler.embed(prompt_ids), ids, mode)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.3, top_p=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_log_softmax_of_the_runtime_logits(vlm, sampling):
    """The chosen token's logprob is log_softmax of the logits the runtime computes for it (the same graph
    teacher-forced along the answer), before temperature and top-p (a sampled answer reports the model's
    distribution too); top_logprobs are that row's best, best first; the answer is the one without logprobs."""
    plain = vlm(PROMPT, max_new_tokens=N, sampling=sampling, ignore_eos=True)
    r = vlm(PROMPT, max_new_tokens=N, sampling=sampling, ignore_eos=True, logprobs=5)
    assert r.token_ids == plain.token_ids and r.text == plain.text and plain.logprobs is None
    assert [e.id for e in r.logprobs] == r.token_ids
    rows = _teacher_forced(vlm, r.prompt_ids, r.token_ids)
    for e, row in zip(r.logprobs, rows):
        ref = log_softmax(row)
        assert abs(e.logprob - ref[e.id]) < 1e-5
        assert [t.id for t in e.top] == list(np.argsort(-row, kind="stable")[:5])
        assert max(abs(t.logprob - ref[t.id]) for t in e.top) < 1e-5
    if sampling.temperature == 0:
        assert all(e.top[0].id == e.id for e in r.logprobs)  # greedy: the best is the one chosen
    # the tokens' bytes are the answer's text (a random model's: with pieces of characters, special tokens kept)
    text = vlm.bundle.tokenizer.decode(r.token_ids, skip_special_tokens=False)
    assert b"".join(e.bytes for e in r.logprobs).decode("utf-8", "replace") == text
    assert all(e.token == e.bytes.decode("utf-8", "backslashreplace") for e in r.logprobs)


def test_logprobs_under_a_grammar_are_the_model_distribution_before_its_mask(vlm):
    """A constrained answer's logprobs (response_format: a regex) are log_softmax of the whole logits row, before the
    grammar's mask as before temperature (not renormalized over the allowed tokens): equal to the teacher-forced
    rows', so the random model's best token, which the grammar forbids at some place, is listed first there; the
    answer is the constrained one without logprobs (guards the merge of s18-grammar and s18-logprobs)."""
    from vlmrt.runtime.decode.grammar import GrammarSpec

    spec = GrammarSpec("regex", "(red|green|blue)( (red|green|blue)){2,5}")
    plain = vlm(PROMPT, max_new_tokens=N, response_format=spec)
    r = vlm(PROMPT, max_new_tokens=N, response_format=spec, logprobs=3)
    assert r.token_ids == plain.token_ids and r.text == plain.text
    assert [e.id for e in r.logprobs] == r.token_ids
    rows = _teacher_forced(vlm, r.prompt_ids, r.token_ids)
    for e, row in zip(r.logprobs, rows):
        ref = log_softmax(row)
        assert abs(e.logprob - ref[e.id]) < 1e-5
        assert [t.id for t in e.top] == list(np.argsort(-row, kind="stable")[:3])
    assert any(e.top[0].id != e.id for e in r.logprobs)  # the model's best was not allowed there


def test_logprobs_equal_transformers_on_fp32_weights(tiny, vlm):
    """The fp32 bundle's logprobs against log_softmax of transformers' logits on the same checkpoint, teacher-forced
    along the bundle's greedy answer: within 2e-5 (measured: 2.3e-6 at most here), the same top 5."""
    import torch

    model, _ = tiny.hf()
    r = vlm(PROMPT, max_new_tokens=N, ignore_eos=True, logprobs=5)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([r.prompt_ids + r.token_ids])).logits[0].numpy()
    ref = logits[len(r.prompt_ids) - 1 : -1]
    worst = 0.0
    for e, row in zip(r.logprobs, ref):
        lp = log_softmax(row)
        worst = max(worst, abs(e.logprob - lp[e.id]), *(abs(t.logprob - lp[t.id]) for t in e.top))
        assert [t.id for t in e.top] == list(np.argsort(-row, kind="stable")[:5])
    assert worst < 2e-5, worst


def test_only_the_sequences_that_ask_compute_them_in_the_batched_round(tiny, vlm, monkeypatch):
    """Two answers decoding together through the batched call, one asking for logprobs: its logprobs equal its answer
    alone's, and token_logprobs runs only for its tokens (the other costs nothing)."""
    alone = vlm.chat([TEXT], max_new_tokens=N, ignore_eos=True, logprobs=3)
    want = list(alone)
    want_lp = [(e.id, e.logprob, [t.id for t in e.top]) for e in vlm.result.logprobs]
    calls = []
    real = scheduler_module.token_logprobs
    monkeypatch.setattr(scheduler_module, "token_logprobs", lambda *a: calls.append(a[1]) or real(*a))
    vlms = VLM.slots(Bundle.open(tiny.bundle), 2)
    assert vlms[0].scheduler.batched
    loop = AnswerLoop(vlms)
    loop.begin(vlms[0].chat_answer([{"role": "user", "content": "a longer question than the other one"}],
                                   max_new_tokens=N + 4, ignore_eos=True))
    loop.begin(vlms[1].chat_answer([TEXT], max_new_tokens=N, ignore_eos=True, logprobs=3))
    done = {}
    while loop.busy:
        done.update({slot: v for slot, kind, v in loop.round() if kind == "done"})
    assert done[1].text == "".join(want) and done[0].logprobs is None
    assert [(e.id, e.logprob, [t.id for t in e.top]) for e in done[1].logprobs] == want_lp
    assert calls == done[1].token_ids


def test_logprobs_with_lookahead_are_those_of_plain_decoding(tiny, vlm, monkeypatch):
    """Lookahead decoding (several tokens a call, each from its own verify row) records each token's logprobs as
    plain decoding does (to the float rounding of a multi-row call)."""
    from vlmrt.runtime.decode import lookahead

    # 2-grams and short pauses (as test_lookahead_bundles): a random fixture model copies by chance only
    monkeypatch.setattr(lookahead, "NGRAMS", (3, 2))
    monkeypatch.setattr(lookahead, "FIRST_PAUSE", 4)
    copying = "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana."
    plain = vlm(copying, max_new_tokens=24, ignore_eos=True, logprobs=2)
    r = VLM.load(tiny.bundle, lookahead=4)(copying, max_new_tokens=24, ignore_eos=True, logprobs=2)
    assert r.token_ids == plain.token_ids and r.stats.accepted_tokens > 0
    assert [e.id for e in r.logprobs] == r.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(r.logprobs, plain.logprobs)) < 1e-4
    assert [[t.id for t in e.top] for e in r.logprobs] == [[t.id for t in e.top] for e in plain.logprobs]


def test_token_bytes_spell_pieces_of_characters(vlm):
    """A character split over byte-level tokens: each token's bytes are its piece, its text the \\xNN escapes
    (OpenAI's); the whole answer's bytes join back; a SentencePiece-style vocabulary with byte fallback too."""
    from tokenizers import Tokenizer, decoders, models

    tok = vlm.bundle.tokenizer
    tb = TokenBytes(tok)
    text = " ✓ café"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert b"".join(tb.bytes(i) for i in ids) == text.encode()
    partial = [i for i in ids if len(tb.bytes(i)) and not _whole(tb.bytes(i))]
    assert partial and all(tb.text(i).startswith("\\x") or "\\x" in tb.text(i) for i in partial)

    sp = Tokenizer(models.BPE({"▁Hi": 0, "<0xE2>": 1, "<0x9C>": 2, "<0x93>": 3, "x": 4}, [], byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    spb = TokenBytes(sp)
    assert [spb.bytes(i) for i in range(5)] == [b" Hi", b"\xe2", b"\x9c", b"\x93", b"x"]
    assert spb.text(1) == "\\xe2"


def _whole(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_bad_logprobs_in_the_python_api(vlm):
    for bad in (21, -1, True, 2.0):
        with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
            vlm(PROMPT, max_new_tokens=2, logprobs=bad)


# ------------------------------------------------------------------------- the command line


def test_cli_run_chat_and_batch_give_logprobs(tiny, vlm, tmp_path, capsys, monkeypatch):
    """vlmrt run --logprobs 3: --json carries VLM.generate(logprobs=3)'s entries in OpenAI's shape (and no logprobs
    key without the flag); the text mode prints the answer alone on stdout and a line per token on stderr; vlmrt chat
    prints each turn's on stderr; vlmrt batch --logprobs 2 writes them in each answer's line (all fail on 9ee29fd:
    no --logprobs)."""
    import io

    from vlmrt import cli

    base = ["run", str(tiny.bundle), "--prompt", PROMPT, "--max-new-tokens", str(N), "--ignore-eos"]
    want = vlm(PROMPT, max_new_tokens=N, ignore_eos=True, logprobs=3)
    assert cli.main([*base, "--logprobs", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == want.token_ids and out["logprobs"] == [e.as_dict() for e in want.logprobs]
    assert cli.main([*base, "--json"]) == 0 and "logprobs" not in json.loads(capsys.readouterr().out.splitlines()[-1])
    assert cli.main([*base, "--logprobs", "3"]) == 0
    o, e = capsys.readouterr()
    assert o == want.text + "\n"  # the answer alone
    table = e.splitlines()[1: 1 + N]  # (after the header; the report follows)
    assert e.splitlines()[0].split() == ["#", "token", "logprob"] and len(table) == N
    for i, (line, x) in enumerate(zip(table, want.logprobs)):
        assert line.startswith(f"{i:>4}  {json.dumps(x.token, ensure_ascii=False)} ") and f" {x.logprob:.4f}" in line
        assert line.count(" top: ") == 1 and [json.dumps(t.token, ensure_ascii=False) in line for t in x.top] == [True] * 3

    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    assert cli.main(["chat", str(tiny.bundle), "--max-new-tokens", str(N), "--ignore-eos", "--logprobs", "1"]) == 0
    o, e = capsys.readouterr()
    turn = "".join(vlm.chat([{"role": "user", "content": PROMPT}], max_new_tokens=N, ignore_eos=True, logprobs=1))
    assert o == turn + "\n" and len([ln for ln in e.splitlines() if " top: " in ln]) == N
    vlm.reset()

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": PROMPT}) + "\n" + json.dumps({"id": 2, "prompt": "hi"}) + "\n")
    assert cli.main(["batch", str(tiny.bundle), "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
                     "--max-new-tokens", str(N), "--ignore-eos", "--logprobs", "2", "--quiet"]) == 0
    capsys.readouterr()
    lines = {d["id"]: d for d in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for rid, prompt in ((1, PROMPT), (2, "hi")):
        r = vlm(prompt, max_new_tokens=N, ignore_eos=True, logprobs=2)
        assert lines[rid]["logprobs"] == [e.as_dict() for e in r.logprobs], rid
    assert json.loads((tmp_path / "out.jsonl.options.json").read_text())["logprobs"] == 2  # (a resume keeps it)


@pytest.mark.parametrize("command", ["run", "chat", "batch"])
def test_cli_bad_logprobs_are_one_line_exit_2(tiny, capsys, command):
    from vlmrt import cli

    for bad in ("21", "-1", "2.5"):
        with pytest.raises(SystemExit) as e:
            cli.main([command, str(tiny.bundle), "--logprobs", bad])
        o, err = capsys.readouterr()
        assert e.value.code == 2 and o == "" and len(err.splitlines()) == 1, err
        assert err.startswith(f"vlmrt {command}: error: argument --logprobs: '{bad}': the top tokens to list "
                              "beside each token, 0 to 20"), err


# ------------------------------------------------------------------------- the server, with the openai SDK


@pytest.fixture(scope="module")
def served(tiny):
    r = start(tiny.bundle, "--slots", "2", "--queue", "4")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _entries(content) -> list[tuple]:
    return [(c.token, round(c.logprob, 5), tuple(c.bytes), [(t.token, round(t.logprob, 5)) for t in c.top_logprobs])
            for c in content]


def test_chat_logprobs_whole_and_streamed(client, vlm):
    """choices[0].logprobs.content: one entry per answer token (token, logprob, bytes, top_logprobs) equal to
    VLM.chat's; streamed, the chunks' entries together are the same, each content chunk carrying its tokens'."""
    messages = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=True, top_logprobs=3)
    lp = out.choices[0].logprobs.content
    vlm.reset()
    "".join(vlm.chat(messages, max_new_tokens=N, logprobs=3))
    ref = vlm.result.logprobs
    assert len(lp) == out.usage.completion_tokens == len(ref)
    assert [c.token for c in lp] == [e.token for e in ref] and [c.bytes for c in lp] == [list(e.bytes) for e in ref]
    assert max(abs(c.logprob - e.logprob) for c, e in zip(lp, ref)) < 1e-6
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in lp)  # greedy

    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [c for x in chunks if x.choices and x.choices[0].logprobs for c in x.choices[0].logprobs.content]
    assert _entries(streamed) == _entries(lp)
    # a content chunk carries the tokens its text came from (a random model's pieces of characters: held back
    # together); the first (role) chunk none
    texts = [x for x in chunks if x.choices and x.choices[0].delta.content]
    assert texts and all(x.choices[0].logprobs.content for x in texts)
    assert chunks[0].choices[0].logprobs.content == []

    # a stop string: the answer cut, its tokens to the one that completed it (their text held back, then dropped:
    # their entries come with the finish chunk)
    text = out.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=True, top_logprobs=3,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    whole = cut.choices[0].logprobs.content
    assert len(whole) == cut.usage.completion_tokens < N and _entries(whole) == _entries(lp[: len(whole)])
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=True,
                                                 top_logprobs=3, stop=[stop], stream=True))
    assert _entries([c for x in chunks if x.choices and x.choices[0].logprobs
                     for c in x.choices[0].logprobs.content]) == _entries(whole)

    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=False)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    top0 = client.chat.completions.create(model="m", messages=messages, max_tokens=N, logprobs=True)
    assert [c.top_logprobs for c in top0.choices[0].logprobs.content] == [[]] * len(lp)


def test_responses_logprobs_whole_and_streamed(client):
    """The Responses API: include ["message.output_text.logprobs"] and top_logprobs: output_text.logprobs, and in a
    stream each output_text.delta's logprobs (together: the done event's)."""
    kw = dict(model="m", input="Say something.", max_output_tokens=N, include=["message.output_text.logprobs"],
              top_logprobs=2)
    out = client.responses.create(**kw)
    lp = out.output[0].content[0].logprobs
    assert len(lp) == out.usage.output_tokens and all(len(c.top_logprobs) == 2 for c in lp)
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say something."}],
                                          max_tokens=N, logprobs=True, top_logprobs=2)
    assert _entries(lp) == _entries(chat.choices[0].logprobs.content)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [c for e in events if e.type == "response.output_text.delta" for c in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _entries(deltas) == _entries(done.logprobs) == _entries(lp)
    assert client.responses.create(model="m", input="Say something.", max_output_tokens=N).output[0].content[0].logprobs == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/responses", {"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ("/v1/responses", {"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(served, path, body, param):
    base = {"messages": [TEXT]} if path == "/v1/chat/completions" else {"input": "hi"}
    status, got, _ = request(served, "POST", path, json.dumps({**base, **body}).encode())
    assert status == 400 and got["error"]["param"] == param and got["error"]["message"].startswith(param), got


# ------------------------------------------------------------------------- the demo model: real text, tools


@pytest.fixture(scope="module")
def demo(demo_model):
    r = start(demo_model[1], "--slots", "1", "--queue", "2")
    yield r, VLM.load(demo_model[1])
    r.stop()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_demo_model_logprobs_with_tools_through_the_sdk(demo):
    """The offline demo model (trained: real words) through the openai SDK with tools (its template has none: the
    generic format) and logprobs: the answer is VLM.chat's with the same tools, its tokens' bytes are its text,
    each streamed content chunk carries exactly the tokens of its text (the SDK's whole and streamed entries equal).
    Its 128-token context holds the generic tool turn but not a follow-up with the call and its result: a 400 that
    says so."""
    r, ref = demo
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="m", messages=q, tools=[WEATHER], max_tokens=12, logprobs=True, top_logprobs=2)
    out = c.chat.completions.create(**kw)
    text = out.choices[0].message.content
    ref.reset()
    assert text == "".join(ref.chat(q, max_new_tokens=12, tools=[WEATHER], logprobs=2)) and text.strip()
    lp = out.choices[0].logprobs.content
    assert [c.token for c in lp] == [e.token for e in ref.result.logprobs]
    assert bytes(b for e in lp for b in e.bytes).decode() == text
    assert "".join(e.token for e in lp) == text
    chunks = list(c.chat.completions.create(**kw, stream=True))
    pieces = [x.choices[0] for x in chunks if x.choices and x.choices[0].delta.content]
    assert "".join(p.delta.content for p in pieces) == text
    for p in pieces:
        assert "".join(e.token for e in p.logprobs.content) == p.delta.content
    assert _entries([e for x in chunks if x.choices and x.choices[0].logprobs
                     for e in x.choices[0].logprobs.content]) == _entries(lp)
    follow = q + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                                     "content": "sunny, 21 C"}]
    with pytest.raises(openai.BadRequestError, match="max context is 128"):
        c.chat.completions.create(model="m", messages=follow, tools=[WEATHER], max_tokens=4)
