"""The OpenAI API as its clients use it (issue 49), driven with the official openai SDK against `vlmrt serve` on
loopback: GET /metrics parsed by prometheus_client's parser after real requests, POST /v1/responses (plain, image,
streamed, multi-turn, refusals), tools in chat completions (rendered through the checkpoint's template, tool
messages in the next turn). The tool-call parsers on each template format's real output: tests/test_tool_calls.py."""

from __future__ import annotations

import json

import pytest

from serve_client import (  # noqa: F401  (fixtures: tiny, server, client, vlm)
    TEXT, ask, client, direct, openai, picture, request, server, start, tiny, uri, vlm)

prometheus = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

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
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, "text.format"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
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
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0]: item type"),
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
