"""The OpenAI API as its clients use it (issue 49), driven with the official openai SDK against `vlmrt serve` on
loopback: GET /metrics parsed by prometheus_client's parser after real requests, POST /v1/responses (plain, image,
streamed, multi-turn, refusals), tools in chat completions (rendered through the checkpoint's template, tool
messages in the next turn). The tool-call parsers on each template format's real output: tests/test_tool_calls.py."""

from __future__ import annotations

import json
import time
from typing import Literal

import pytest

from serve_client import (  # noqa: F401  (fixtures: tiny, server, client, vlm)
    TEXT, ask, client, direct, openai, picture, request, server, start, tiny, uri, vlm, wait_idle)

prometheus = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vlmrt.runtime.vlm import VLM  # noqa: E402

pydantic = pytest.importorskip("pydantic")

KEY = "sk-metrics-test"


@pytest.fixture(scope="module")
def keyed(tiny):
    r = start(tiny.bundle, "--slots", "2", "--queue", "4", "--api-key", KEY)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def keyed_client(keyed):
    return openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(r) -> dict:
    """{sample name: {labels as a sorted tuple: value}} of GET /metrics, parsed by prometheus_client."""
    status, body, headers = request(r, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4"), (status, body)
    out: dict = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(m: dict, name: str, **labels) -> float:
    return m.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


# ------------------------------------------------------------------------- GET /metrics


def test_metrics_after_real_requests(keyed, keyed_client):
    before = scrape(keyed)
    assert request(keyed, "GET", "/metrics")[0] == 401  # behind --api-key like every route but / and /health
    assert one(before, "vlmrt_model_loaded") == 1 and one(before, "vlmrt_slots") == 2
    assert one(before, "vlmrt_kv_cache_bytes") > 0
    max_context = keyed.app.state.vlmrt.scheduler.max_context
    assert one(before, "vlmrt_kv_cache_rows") == 2 * max_context

    messages = [ask("What is in the picture?", uri(picture(4)))]
    a = keyed_client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    again = keyed_client.chat.completions.create(model="m", messages=messages, max_tokens=8)  # its rows kept
    chunks = list(keyed_client.chat.completions.create(model="m", messages=[TEXT], max_tokens=5, stream=True,
                                                       stream_options={"include_usage": True}))
    b = chunks[-1]
    with pytest.raises(openai.BadRequestError):
        keyed_client.chat.completions.create(model="m", messages=[TEXT], max_tokens=0)
    assert request(keyed, "GET", "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})[0] == 404
    after = scrape(keyed)

    def grew(name, **labels):
        return one(after, name, **labels) - one(before, name, **labels)

    route = "/v1/chat/completions"
    assert grew("vlmrt_requests_total", route=route, status="200") == 3
    assert grew("vlmrt_requests_total", route=route, status="400") == 1
    assert grew("vlmrt_requests_total", route="other", status="404") == 1
    assert grew("vlmrt_requests_total", route="/metrics", status="401") == 1
    assert grew("vlmrt_requests_total", route="/metrics", status="200") == 1  # the first scrape (counted as it began)
    assert grew("vlmrt_prompt_tokens_total") == a.usage.prompt_tokens * 2 + b.usage.prompt_tokens
    assert grew("vlmrt_generated_tokens_total") == (a.usage.completion_tokens + b.usage.completion_tokens
                                                    + again.usage.completion_tokens)
    assert grew("vlmrt_cached_prompt_tokens_total") == again.usage.prompt_tokens_details.cached_tokens > 0
    assert grew("vlmrt_images_total") == 2 and grew("vlmrt_images_cached_total") == 1
    assert grew("vlmrt_time_to_first_token_seconds_count") == 3
    assert grew("vlmrt_time_to_first_token_seconds_sum") > 0
    assert grew("vlmrt_inter_token_latency_seconds_count") == grew("vlmrt_generated_tokens_total") - 3
    assert grew("vlmrt_scheduler_jobs_total", outcome="completed") == 3
    assert grew("vlmrt_scheduler_jobs_total", outcome="refused") == 0  # max_tokens 0 is refused before the queue
    assert one(after, "vlmrt_slots_busy") == 0 and one(after, "vlmrt_queue_depth") == 0
    assert one(after, "vlmrt_image_cache_bytes") > 0
    # the rows the slots keep for prefix reuse: at least the last answer's (its prompt and all its tokens but the last)
    assert b.usage.total_tokens - 1 <= one(after, "vlmrt_kv_cache_rows_used") <= 2 * max_context


def test_inter_token_latency_is_each_gap(keyed, keyed_client, monkeypatch):
    """vlmrt_inter_token_latency_seconds observes each gap between an answer's tokens: one round planted 0.5 s slow
    shows as one gap over 0.25 s, the others under it (observed at the answer's mean decode time per token, every
    token fell in the same bucket)."""
    loop = keyed.app.state.vlmrt.scheduler.loop
    real, rounds = loop.round, []

    def slow():
        rounds.append(1)
        if len(rounds) == 5:  # (rounds 1-2: the prompt's blocks; then a token each)
            time.sleep(0.5)
        return real()

    before = scrape(keyed)
    monkeypatch.setattr(loop, "round", slow)
    out = keyed_client.chat.completions.create(model="m", messages=[TEXT], max_tokens=10, extra_body={"ignore_eos": True})
    monkeypatch.setattr(loop, "round", real)
    after = scrape(keyed)
    assert out.usage.completion_tokens == 10 and len(rounds) > 6

    def grew(name, **labels):
        return one(after, name, **labels) - one(before, name, **labels)

    assert grew("vlmrt_inter_token_latency_seconds_count") == 9
    assert grew("vlmrt_inter_token_latency_seconds_bucket", le="0.25") == 8
    assert grew("vlmrt_inter_token_latency_seconds_sum") >= 0.5


# ------------------------------------------------------------------------- POST /v1/responses


def post_responses(r, obj):
    return request(r, "POST", "/v1/responses", json.dumps(obj).encode())


def test_responses_plain_image_and_multi_turn(client, vlm):
    out = client.responses.create(model="m", input="hi", max_output_tokens=8)
    want = direct(vlm, [TEXT], max_new_tokens=8)
    assert out.object == "response" and out.output_text == want and out.output[0].role == "assistant"
    assert out.usage.input_tokens == vlm.result.stats.prompt_tokens
    assert out.usage.output_tokens == vlm.result.stats.generated_tokens
    cut = vlm.result.stats.stop_reason in ("length", "context")
    assert out.status == ("incomplete" if cut else "completed")
    assert (out.incomplete_details.reason if cut else out.incomplete_details) == ("max_output_tokens" if cut else None)

    image = uri(picture(5))
    system = {"role": "system", "content": "Answer briefly."}
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": image},
                                          {"type": "input_text", "text": "What is in the picture?"}]}]
    out = client.responses.create(model="m", input=items, instructions="Answer briefly.", max_output_tokens=10,
                                  temperature=0.8, top_p=0.9, extra_body={"seed": 7})
    messages = [system, ask("What is in the picture?", image)]
    assert out.output_text == direct(vlm, messages, max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    assert out.model_extra["vlmrt"]["images"] == 1

    items += [{"role": "assistant", "content": [{"type": "output_text", "text": out.output_text}]},
              {"role": "user", "content": "And its colour?"}]
    follow = client.responses.create(model="m", input=items, instructions="Answer briefly.", max_output_tokens=10)
    messages += [{"role": "assistant", "content": out.output_text}, {"role": "user", "content": "And its colour?"}]
    assert follow.output_text == direct(vlm, messages, max_new_tokens=10)
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the conversation's rows kept on its slot


def test_responses_streamed(client, vlm):
    image = uri(picture(6))
    want = direct(vlm, [ask("Describe it.", image)], max_new_tokens=12)
    events = list(client.responses.create(model="m", max_output_tokens=12, stream=True, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": image},
                                     {"type": "input_text", "text": "Describe it."}]}]))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    end = "response.incomplete" if vlm.result.stats.stop_reason in ("length", "context") else "response.completed"
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done", end])
    assert len(deltas) > 1 and "".join(deltas) == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1].response
    assert last.output_text == want and last.usage.output_tokens == vlm.result.stats.generated_tokens
    assert events[-4].text == want and events[-2].item.content[0].text == want


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),  # (hosted tools: function tools only)
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
])
def test_responses_refusals_name_the_field(server, body, param):
    status, got, _ = post_responses(server, {"model": "m", "input": "hi", **body})
    assert status == 400 and got["error"]["param"] == param and got["error"]["code"] == "unsupported_parameter", got
    assert got["error"]["message"].startswith(param + ":")


@pytest.mark.parametrize("body, says", [
    ({"input": []}, "input must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]: input_image needs"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]: unknown"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]: item type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "tool_call_id 'c' is not the id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]: role"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be"),
    ({"input": "hi", "temperature": 9}, "temperature must be"),
    ({"input": [{"role": "assistant", "content": "hi"}]}, "the last message must be the user's"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}]},
     "only data:image URIs"),
])
def test_responses_bad_input_is_a_400(server, body, says):
    status, got, _ = post_responses(server, {"model": "m", **body})
    assert status == 400 and says in got["error"]["message"], got


# ------------------------------------------------------------------------- tools in chat completions

WEATHER = {"type": "function", "function": {  # short: the tiny bundles' context is 320 tokens
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


def follow_up(call_id: str, arguments: str = '{"city": "Paris"}') -> list[dict]:
    """The question, the assistant's call, the tool's result: the next turn's messages."""
    return [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "clear", "c": 21}'}]


def scripted(r, text: str, own: list) -> None:
    """Each slot of r answers text (in pieces of 5 characters) after running its real answer (own: the slots'
    (stream, finish) methods; the answer's decode steps go to the scheduler as usual): what a model that calls a tool
    would write, which a random tiny model does not."""
    for slot, (stream, finish) in zip(r.app.state.vlmrt.scheduler.slots, own):

        def quiet(a, ids, stream=stream):
            for _ in stream(a, ids):  # (the real pieces, dropped)
                pass
            return
            yield

        def done(a, finish=finish, vlm=slot.vlm):
            for _ in finish(a):
                pass
            vlm.result.text = text
            yield from (text[i:i + 5] for i in range(0, len(text), 5))

        slot.vlm.stream, slot.vlm.finish = quiet, done


def qwen3_vl(tmp_path_factory):
    from family_cases import QWEN_CASES, qwen_exported

    return qwen_exported(next(c for c in QWEN_CASES if c.name == "qwen3-vl"), tmp_path_factory).bundle


@pytest.fixture(scope="module")
def qwen_plain(tmp_path_factory):
    """The Qwen3-VL tiny bundle (its fixture template has no tool parts: the generic format; its context holds the
    generic tool turns, which the SmolVLM tiny bundle's 320 tokens of a 480-token vocabulary do not), one slot."""
    bundle = qwen3_vl(tmp_path_factory)
    r = start(bundle, "--slots", "1", "--queue", "4")
    yield r, VLM.load(bundle)
    r.stop()


def with_template(source, tmp_path_factory, name: str, template: str, renamed: dict[str, str] | None = None):
    """A copy of the bundle at source whose manifest holds the chat template (the checkpoint's tool parts) and whose
    tokenizer's unused added tokens are renamed (renamed: old -> new content; the ids and rows stay, the manifest
    records the tokenizer's new hash), served with one slot: yields (server, VLM) and stops the server."""
    import shutil

    from vlmrt.format.manifest import sha256_file

    bundle = tmp_path_factory.mktemp(name) / "bundle"
    shutil.copytree(source, bundle)
    m = json.loads((bundle / "manifest.json").read_text())
    m["prompt"]["chat_template"] = template
    if renamed:
        path = bundle / m["tokenizer_file"]
        tok = json.loads(path.read_text())
        for t in tok["added_tokens"]:
            t["content"] = renamed.get(t["content"], t["content"])
        path.write_text(json.dumps(tok))
        m["files"][m["tokenizer_file"]].update(sha256=sha256_file(path), bytes=path.stat().st_size)
    (bundle / "manifest.json").write_text(json.dumps(m))
    r = start(bundle, "--slots", "1", "--queue", "4")
    yield r, VLM.load(bundle)
    r.stop()


@pytest.fixture(scope="module")
def qwen_tools(tmp_path_factory):
    """The Qwen3-VL tiny bundle with its template's tool parts (tests/tool_templates.py: hermes), one slot."""
    from tool_templates import QWEN3_VL_TOOLS

    yield from with_template(qwen3_vl(tmp_path_factory), tmp_path_factory, "qwen-tools", QWEN3_VL_TOOLS)


@pytest.fixture(scope="module")
def qwen_xml_tools(tmp_path_factory):
    """The Qwen3-VL tiny bundle with Qwen3.5's tool parts (tests/tool_templates.py: qwen_xml), one slot."""
    from tool_templates import QWEN35_TOOLS

    yield from with_template(qwen3_vl(tmp_path_factory), tmp_path_factory, "qwen-xml-tools", QWEN35_TOOLS)


@pytest.fixture(scope="module")
def lfm2_tools(tmp_path_factory):
    """The LFM2-VL tiny bundle (family_cases.LFM2_CASES[0]) with its template's tool parts (pythonic), one slot; two
    of its tokenizer's grid markers that no test image reaches (row 10, columns 9 and 10) renamed <|tool_call_start|>
    and <|tool_call_end|>: special tokens, as in the released tokenizer (ids 10 and 11 there)."""
    from family_cases import LFM2_CASES, lfm2_exported
    from tool_templates import LFM2_VL_TOOLS

    yield from with_template(lfm2_exported(LFM2_CASES[0], tmp_path_factory).bundle, tmp_path_factory, "lfm2-tools",
                             LFM2_VL_TOOLS, {"<|img_row_10_col_9|>": "<|tool_call_start|>",
                                             "<|img_row_10_col_10|>": "<|tool_call_end|>"})


@pytest.fixture(scope="module")
def gemma4_tools(tmp_path_factory):
    """The Gemma 4 tiny bundle with Gemma 4's tool parts (tests/tool_templates.py: gemma4), one slot; its tokenizer's
    three audio markers (unused without audio) renamed <|tool_call>, <tool_call|> and <|"|>: special tokens, as in
    the released tokenizer, so that the answer's text must keep them (VLM._kept)."""
    from family_cases import GEMMA4_CASES, gemma4_exported
    from fixtures_gemma4 import AUDIO, BOA, EOA
    from tool_templates import GEMMA4_TOOLS

    yield from with_template(gemma4_exported(GEMMA4_CASES[0], tmp_path_factory).bundle, tmp_path_factory,
                             "gemma4-tools", GEMMA4_TOOLS, {BOA: "<|tool_call>", AUDIO: "<tool_call|>", EOA: '<|"|>'})


@pytest.mark.parametrize("served", ["qwen_plain", "qwen_tools", "qwen_xml_tools", "lfm2_tools"],
                         ids=["generic", "hermes", "qwen_xml", "pythonic"])
def test_tools_rendered_then_a_tool_result_in_the_next_turn(served, request):
    """tools go into the prompt through the checkpoint's template (the answer is VLM.chat's with the same tools);
    the next turn with the assistant's tool_calls and a tool message is answered, the conversation's rows reused."""
    r, ref = request.getfixturevalue(served)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    plain = c.chat.completions.create(model="m", messages=[QUESTION], max_tokens=6)
    none = c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], tool_choice="none", max_tokens=6)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # tool_choice none: the tools are left out
    out = c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], max_tokens=6)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools are in the prompt
    assert out.choices[0].message.content == direct(ref, [QUESTION], max_new_tokens=6, tools=[WEATHER])
    assert ref.result.stats.prompt_tokens == out.usage.prompt_tokens

    messages = follow_up("call_abc")
    nxt = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=6)
    assert nxt.choices[0].message.content == direct(ref, messages, max_new_tokens=6, tools=[WEATHER])
    assert nxt.usage.prompt_tokens == ref.result.stats.prompt_tokens
    # the turn before kept, as far as whole prefill blocks go (the case's prefill_ar: 16 tokens)
    assert nxt.usage.prompt_tokens_details.cached_tokens > out.usage.prompt_tokens - 16
    streamed = list(c.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=6, stream=True))
    assert "".join(x.choices[0].delta.content or "" for x in streamed if x.choices) == nxt.choices[0].message.content


TWO_CALLS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'),
    "qwen_xml": ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n"
                 "</function>\n</tool_call>"),
}


@pytest.mark.parametrize("served, fmt", [("qwen_tools", "hermes"), ("qwen_xml_tools", "qwen_xml")],
                         ids=["hermes", "qwen_xml"])
def test_tool_calls_answered_as_openai_answers_them(served, fmt, request):
    """An answer in the template's own format (hermes: Qwen3-VL's <tool_call> JSON; qwen_xml: Qwen3.5's <function=>
    blocks; scripted: a random model does not call tools) comes back as tool_calls with finish_reason tool_calls,
    whole and streamed as OpenAI streams them (the SDK's accumulated deltas); a plain answer stays content."""
    r, _ = request.getfixturevalue(served)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    own = [(slot.vlm.stream, slot.vlm.finish) for slot in r.app.state.vlmrt.scheduler.slots]
    answer = TWO_CALLS[fmt]
    scripted(r, answer, own)
    try:
        out = c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], max_tokens=4)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        calls = choice.message.tool_calls
        assert [(t.type, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Nice"})]
        assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id

        chunks = list(c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], max_tokens=4,
                                                stream=True))
        deltas = [x.choices[0].delta for x in chunks if x.choices]
        assert "".join(d.content or "" for d in deltas).strip() == "Let me check."  # sent before the call began
        assert not any("<tool" in (d.content or "") for d in deltas)
        got: dict = {}
        for d in deltas:
            for t in d.tool_calls or ():
                e = got.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                e["name"] += t.function.name or ""
                e["arguments"] += t.function.arguments or ""
        assert [(e["name"], json.loads(e["arguments"])) for e in got.values()] == [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice"})]
        assert all(e["id"].startswith("call_") for e in got.values())
        assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["tool_calls"]

        # the follow-up with those calls and their results is answered
        messages = [QUESTION, choice.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": t.id, "content": "clear"} for t in calls]
        scripted(r, "Clear in both.", own)
        after = c.chat.completions.create(model="m", messages=messages, tools=[WEATHER], max_tokens=4)
        assert after.choices[0].message.content == "Clear in both." and after.choices[0].finish_reason != "tool_calls"
        assert after.usage.prompt_tokens_details.cached_tokens > 0
        # a call to a function that was not given is not a tool call: the text comes back as it is
        wrong = answer.replace("get_weather", "delete_files")
        scripted(r, wrong, own)
        out = c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], max_tokens=4)
        assert out.choices[0].message.content == wrong and not out.choices[0].message.tool_calls
        chunks = list(c.chat.completions.create(model="m", messages=[QUESTION], tools=[WEATHER], max_tokens=4,
                                                stream=True))
        assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == wrong
    finally:
        for slot, (stream, finish) in zip(r.app.state.vlmrt.scheduler.slots, own):
            slot.vlm.stream, slot.vlm.finish = stream, finish


BAD_TOOLS = [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.mark.parametrize("body, param", BAD_TOOLS)
def test_malformed_tools_are_a_400_naming_the_field(server, body, param):
    status, got, _ = request(server, "POST", "/v1/chat/completions",
                             json.dumps({"messages": [QUESTION], **body}).encode())
    assert status == 400 and got["error"]["param"] == param and got["error"]["message"].startswith(param), got


@pytest.mark.parametrize("edit, says", [
    (lambda m: m[2].pop("tool_call_id"), "message 3: a tool message needs tool_call_id"),
    (lambda m: m[2].update(tool_call_id="call_other"), "is not the id of a tool call"),
    (lambda m: m[1]["tool_calls"][0]["function"].update(arguments="{oops"), "function.arguments is not valid JSON"),
    (lambda m: m[1]["tool_calls"][0].update(type="code"), "tool_calls[0] must be"),
])
def test_malformed_tool_messages_are_a_400(server, edit, says):
    messages = follow_up("call_1")
    edit(messages)
    status, got, _ = request(server, "POST", "/v1/chat/completions",
                             json.dumps({"messages": messages, "tools": [WEATHER]}).encode())
    assert status == 400 and says in got["error"]["message"], got


# ------------------------------------------------------------------------- structured output and constrained tools

class Shape(pydantic.BaseModel):
    shape: Literal["circle", "rectangle", "triangle"]
    color: str = pydantic.Field(max_length=12)


SMALL = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["word", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo(demo_model):
    _, bundle = demo_model
    r = start(bundle, "--slots", "2", "--queue", "4")
    yield r, VLM.load(bundle)
    r.stop()


def test_parse_with_a_pydantic_model_and_a_streamed_schema_on_the_demo_model(demo):
    """client.chat.completions.parse(response_format=Model): the answer parses into the model and is VLM.chat's with
    the schema the SDK sent; the same schema streamed gives the same text; json_object gives a JSON object."""
    from openai.lib._parsing._completions import type_to_response_format_param

    r, ref = demo
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [ask("What shape is in the image, and what color is it?", uri(picture(1)))]
    out = c.chat.completions.parse(model="m", messages=messages, response_format=Shape, max_tokens=40)
    choice = out.choices[0]
    assert isinstance(choice.message.parsed, Shape) and choice.finish_reason == "stop"
    rf = type_to_response_format_param(Shape)
    want = direct(ref, messages, max_new_tokens=40, response_format=rf)
    assert choice.message.content == want and ref.result.stats.stop_reason == "grammar"
    assert want == json.dumps(json.loads(want), separators=(",", ":"))  # compact

    chunks = list(c.chat.completions.create(model="m", messages=messages, response_format=rf, max_tokens=40,
                                            stream=True))
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == want
    assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["stop"]
    obj = c.chat.completions.create(model="m", messages=[ask("Describe the image as JSON.", uri(picture(2)))],
                                    response_format={"type": "json_object"}, max_tokens=60)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # out of tokens: the partial text
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")


def test_response_formats_whole_streamed_and_in_the_responses_api(server, client, vlm):
    rf = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
    want = direct(vlm, [TEXT], max_new_tokens=60, response_format=rf)
    assert set(json.loads(want)) == {"word", "n"}
    out = client.chat.completions.create(model="m", messages=[TEXT], response_format=rf, max_tokens=60)
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    resp = client.responses.create(model="m", input="hi", max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "small", "schema": SMALL, "strict": True}})
    assert resp.output_text == want and resp.status == "completed"
    assert resp.text.format.type == "json_schema"
    cut = client.chat.completions.create(model="m", messages=[TEXT], response_format=rf, max_tokens=3)
    assert cut.choices[0].finish_reason == "length" and want.startswith(cut.choices[0].message.content)
    status, body, _ = request(server, "GET", "/metrics")
    compiles = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
                if s.name.startswith("vlmrt_grammar_compile_seconds")}
    assert compiles["vlmrt_grammar_compile_seconds_count"] == 1  # one schema, compiled once, then cached
    assert 0 < compiles["vlmrt_grammar_compile_seconds_sum"] < 5


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "colour"}, "strict": True}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "colour"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string",
                                                                                      "format": "colour"},
                                       "strict": True}}}, "text.format.schema"),
    ("responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": "{"}}}, "text.format.schema"),
])
def test_bad_formats_are_a_400_naming_the_field_and_leak_no_slot(server, route, body, param):
    base = {"messages": [QUESTION]} if route == "chat" else {"model": "m", "input": "hi"}
    status, got, _ = request(server, "POST", "/v1/chat/completions" if route == "chat" else "/v1/responses",
                             json.dumps({**base, **body}).encode())
    assert status == 400 and got["error"]["param"] == param, got
    assert got["error"]["message"].startswith(param + ": ") and "\n" not in got["error"]["message"]
    st = wait_idle(server)
    assert st["busy"] == 0 and st["queued"] == 0
    assert request(server, "POST", "/v1/chat/completions", json.dumps({"messages": [TEXT], "max_tokens": 2}).encode())[0] == 200


PLACE = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("served", ["qwen_plain", "qwen_tools", "qwen_xml_tools", "lfm2_tools"],
                         ids=["generic", "hermes", "qwen_xml", "pythonic"])
def test_named_and_required_tool_calls_follow_the_schema_then_the_follow_up(served, request):
    """tool_choice a named function: one call of it whose arguments validate against its parameters (a random
    model's: the grammar holds them), VLM.chat's with the same tool_choice; required (streamed, one call): a call of
    one of the tools; the follow-up with the call and its result answered, the rows kept. qwen_xml (Qwen3.5) and
    pythonic (LFM2) calls were refused on main (no grammar for them)."""
    r, ref = request.getfixturevalue(served)
    functions = {t["function"]["name"]: t["function"]["parameters"] for t in (PLACE, CLOCK)}
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    tools = [PLACE, CLOCK]
    named = c.chat.completions.create(model="m", messages=[QUESTION], tools=tools, max_tokens=120,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("c", "f") and isinstance(args["city"], str) and len(args["city"]) <= 8
    text = direct(ref, [QUESTION], max_new_tokens=120, tools=tools, tool_choice="get_weather")
    _, calls = ref.template.tool_format.parse(text, functions)
    assert calls == [{"name": "get_weather", "arguments": args}]

    chunks = list(c.chat.completions.create(model="m", messages=[QUESTION], tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, stream=True))
    got: dict = {}
    for d in (x.choices[0].delta for x in chunks if x.choices):
        for t in d.tool_calls or ():
            e = got.setdefault(t.index, {"name": "", "arguments": ""})
            e["name"] += t.function.name or ""
            e["arguments"] += t.function.arguments or ""
    assert len(got) == 1 and got[0]["name"] in ("get_weather", "get_time")
    assert set(json.loads(got[0]["arguments"])) == ({"city", "unit"} if got[0]["name"] == "get_weather" else {"zone"})
    assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["tool_calls"]

    messages = [QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "clear, 21"}]
    # tool_choice auto with a strict tool: text, or calls held to the strict tool's schema (VLM.chat's answer)
    after = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=40)
    text = direct(ref, messages, max_new_tokens=40, tools=tools)
    content, calls = ref.template.tool_format.parse(text, functions)
    if calls:
        assert [(t.function.name, json.loads(t.function.arguments)) for t in after.choices[0].message.tool_calls] \
            == [(c["name"], c["arguments"]) for c in calls]
    else:
        assert after.choices[0].message.content == text
    assert after.usage.prompt_tokens_details.cached_tokens > 0


# ------------------------------------------------------------------------- tools in the Responses API

def responses_tool(t: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
            "strict": t["function"].get("strict")}


def test_responses_function_tools_named_streamed_and_the_follow_up(qwen_tools):
    """Function tools in the Responses shape (refused with a 400 on main): tool_choice a named function gives one
    function_call output item (call_id, name, arguments valid against its parameters: chat's forced call, the same
    text), streamed as OpenAI streams it (output_item.added, function_call_arguments.delta / .done,
    output_item.done); the follow-up with the function_call and its function_call_output items answers as chat's
    follow-up with the assistant's tool_calls and the tool message does, the conversation's rows kept."""
    r, _ = qwen_tools
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    tools, named = [responses_tool(PLACE), responses_tool(CLOCK)], {"type": "function", "name": "get_weather"}
    out = c.responses.create(model="m", input=QUESTION["content"], tools=tools, tool_choice=named,
                             max_output_tokens=120)
    assert out.status == "completed" and [i.type for i in out.output] == ["function_call"], out.output
    call = out.output[0]
    chat = c.chat.completions.create(model="m", messages=[QUESTION], tools=[PLACE, CLOCK], max_tokens=120,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (want,) = chat.choices[0].message.tool_calls
    assert (call.name, call.arguments) == (want.function.name, want.function.arguments)
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 8
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert [t.name for t in out.tools] == ["get_weather", "get_time"] and out.tool_choice.name == "get_weather"

    events = list(c.responses.create(model="m", input=QUESTION["content"], tools=tools, tool_choice=named,
                                     max_output_tokens=120, stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    added, delta, done, item_done, last = events[2:]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.arguments == ""
    assert delta.delta == done.arguments == call.arguments and delta.item_id == added.item.id == item_done.item.id
    assert (item_done.item.name, item_done.item.arguments, item_done.item.status) == (
        "get_weather", call.arguments, "completed")
    assert last.response.output[0].call_id == item_done.item.call_id

    follow = [{"role": "user", "content": QUESTION["content"]},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "clear, 21"}]
    after = c.responses.create(model="m", input=follow, tools=tools, max_output_tokens=20)
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "clear, 21"}]
    chat = c.chat.completions.create(model="m", messages=messages, tools=[PLACE, CLOCK], max_tokens=20)
    if chat.choices[0].message.tool_calls:  # (auto with a strict tool: the random model may call again)
        assert [(i.name, i.arguments) for i in after.output if i.type == "function_call"] == [
            (t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls]
    else:
        assert after.output_text == chat.choices[0].message.content
    assert after.usage.input_tokens == chat.usage.prompt_tokens
    assert after.usage.input_tokens_details.cached_tokens > 0


def test_responses_text_and_calls_streamed_as_items(qwen_tools):
    """An answer with text and two calls (scripted: a random model does not call tools unasked): a message item with
    the text sent before the calls began, then a function_call item per call, whole and streamed."""
    r, _ = qwen_tools
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    own = [(slot.vlm.stream, slot.vlm.finish) for slot in r.app.state.vlmrt.scheduler.slots]
    scripted(r, TWO_CALLS["hermes"], own)
    try:
        tools = [responses_tool(WEATHER)]
        out = c.responses.create(model="m", input=QUESTION["content"], tools=tools, max_output_tokens=4)
        assert [i.type for i in out.output] == ["message", "function_call", "function_call"]
        assert out.output_text == "Let me check."
        assert [json.loads(i.arguments) for i in out.output[1:]] == [{"city": "Paris"}, {"city": "Nice"}]
        events = list(c.responses.create(model="m", input=QUESTION["content"], tools=tools, max_output_tokens=4,
                                         stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text.strip() == "Let me check." and "<tool" not in text
        items = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
        assert items == [(0, "message"), (1, "function_call"), (2, "function_call")]
        final = events[-1].response
        assert events[-1].type == "response.completed" and [i.type for i in final.output] == [
            "message", "function_call", "function_call"]
    finally:
        for slot, (stream, finish) in zip(r.app.state.vlmrt.scheduler.slots, own):
            slot.vlm.stream, slot.vlm.finish = stream, finish


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "colour": 1}]}, "tools[0].colour"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                    "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[2].output[0]"),
])
def test_responses_bad_tools_are_a_400_naming_the_field(server, body, param):
    status, got, _ = post_responses(server, {"model": "m", "input": "hi", **body})
    assert status == 400 and got["error"]["param"] == param and got["error"]["message"].startswith(param + ": "), got


@pytest.mark.parametrize("served, opens, closes", [
    ("gemma4_tools", '<|tool_call>call:w{c:<|"|>', "<tool_call|>"),
    ("lfm2_tools", "<|tool_call_start|>[w(c=", ")]<|tool_call_end|>")], ids=["gemma4", "pythonic"])
def test_calls_with_special_token_markers_held_read_and_answered(served, opens, closes, request):
    """Formats whose markers are special tokens of the released tokenizer (Gemma 4's <|tool_call>, <tool_call|>,
    <|"|>; LFM2's <|tool_call_start|>, <|tool_call_end|>): a named call held to the function's parameters, its markers
    kept in the answer's text so that it reads back as tool_calls (finish_reason tool_calls), streamed alike; the
    tool's result is rendered in the model's turn, which the next answer continues, the rows kept. (Gemma 4 had no
    format on main 9ee29fd; LFM2's markers were dropped from the text on main f2d6421, its calls read only from a bare
    leading list.) One short tool: the tiny bundles' contexts are 256 tokens."""
    r, ref = request.getfixturevalue(served)
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    tool = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"c": {"type": "string", "maxLength": 6}, "u": {"enum": ["c", "f"]}},
        "required": ["c", "u"]}}}
    ask_ = {"role": "user", "content": "Weather?"}
    named = {"type": "function", "function": {"name": "w"}}
    out = c.chat.completions.create(model="m", messages=[ask_], tools=[tool], tool_choice=named, max_tokens=40)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "w" and set(args) == {"c", "u"} and args["u"] in ("c", "f")
    assert isinstance(args["c"], str) and len(args["c"]) <= 6
    text = direct(ref, [ask_], max_new_tokens=40, tools=[tool], tool_choice="w")
    assert text.startswith(opens) and text.endswith(closes), text
    chunks = list(c.chat.completions.create(model="m", messages=[ask_], tools=[tool], tool_choice=named,
                                            max_tokens=40, stream=True))
    streamed = [t for x in chunks if x.choices for t in x.choices[0].delta.tool_calls or ()]
    assert "".join(t.function.arguments or "" for t in streamed) == call.function.arguments
    assert not "".join(x.choices[0].delta.content or "" for x in chunks if x.choices).strip()  # no call as content

    messages = [ask_, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "clear"}]
    after = c.chat.completions.create(model="m", messages=messages, tools=[tool], max_tokens=8)
    assert after.choices[0].message.content == direct(ref, messages, max_new_tokens=8, tools=[tool])
    assert after.usage.prompt_tokens_details.cached_tokens > 0
