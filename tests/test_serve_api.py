"""The OpenAI API as its clients use it (issue 49), driven with the official openai SDK against `vlmrt serve` on
loopback: GET /metrics parsed by prometheus_client's parser after real requests, POST /v1/responses (plain, image,
streamed, multi-turn, refusals), tools in chat completions (rendered through the checkpoint's template, tool
messages in the next turn). The tool-call parsers on each template format's real output: tests/test_tool_calls.py."""

from __future__ import annotations

import json

import pytest

from serve_client import (  # noqa: F401  (fixtures: tiny, vlm)
    TEXT, ask, direct, openai, picture, request, start, tiny, uri, vlm)

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
