"""`vlmrt serve --ray` against `vlmrt serve`: aggregate tokens/s and TTFT p50/p95 of streamed answers at 1, 8 and 32
concurrent conversations with 1 and 2 replicas (each pinned to its own core, --pin-cores), follow-up TTFT with the
conversation router and with Serve's default one (power of two choices), and what Serve's proxy adds (TTFT at 1, a
GET /health round trip). A local Ray cluster on 127.0.0.1 (no dashboard), stopped at the end.

    python benchmarks/serve_ray.py BUNDLE [--slots 4] [--tokens 16] [--json]     (docs/server.md#serving-on-ray)
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from vlmrt.serve import ray_app
from vlmrt.serve.command import add_parser


def picture(i: int) -> str:
    import base64
    import io

    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def first_turn(i: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture(i)}},
                                         {"type": "text", "text": "What shape is in the image?"}]}]


def stream(port: int, messages: list[dict], tokens: int, ignore_eos: bool = True) -> dict:
    """One streamed answer: TTFT (to the first content piece), its tokens (usage), text, the reused prompt tokens."""
    body = json.dumps({"messages": messages, "max_tokens": tokens, "ignore_eos": ignore_eos, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t = time.perf_counter()
    ttft, text, pieces, reused = None, "", 0, 0
    try:
        c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                if ch["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t
                    text += ch["delta"]["content"]
            if ev.get("usage"):
                reused = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
                pieces = ev["usage"]["completion_tokens"]
    finally:
        c.close()
    return {"ttft_s": ttft, "tokens": pieces, "text": text, "reused": reused, "total_s": time.perf_counter() - t}


def pct(xs: list[float], p: float) -> float:
    return float(np.percentile(xs, p)) if xs else float("nan")


def level(port: int, concurrency: int, n: int, tokens: int, seed: int) -> dict:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda i: stream(port, first_turn(seed + i), tokens), range(n)))
    wall = time.perf_counter() - t
    ttfts = [r["ttft_s"] for r in runs]
    return {"concurrency": concurrency, "requests": n, "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95), "wall_s": wall}


def followups(port: int, conversations: int, concurrency: int, tokens: int, seed: int) -> dict:
    """Each conversation: a first turn, then 2 follow-ups, answers ending where the model ends them (an answer past
    its end is not what the next turn's template renders, so nothing could be reused); the follow-ups' TTFT and
    reused prompt tokens (cold: none)."""
    def conversation(i: int) -> list[dict]:
        messages, out = first_turn(seed + i), []
        messages[0]["content"][1]["text"] = (f"This is picture {i} of my set. Look at it carefully and answer in one "
                                              "word: what shape is in the image?")  # a first turn over 2 blocks
        for turn in range(3):
            r = stream(port, messages, tokens, ignore_eos=False)
            out.append(r)
            messages = messages + [{"role": "assistant", "content": r["text"]},
                                   {"role": "user", "content": f"And the colour, {turn}?"}]
        return out[1:]

    with ThreadPoolExecutor(concurrency) as pool:
        runs = [r for conv in pool.map(conversation, range(conversations)) for r in conv]
    ttfts = [r["ttft_s"] for r in runs]
    return {"followups": len(runs), "ttft_p50_s": pct(ttfts, 50), "ttft_p95_s": pct(ttfts, 95),
            "reused_mean": statistics.mean(r["reused"] for r in runs),
            "cold": sum(r["reused"] == 0 for r in runs)}


def health_rtt(port: int, n: int = 50) -> float:
    """GET /health on a fresh connection each (as the streams here), median seconds."""
    ts = []
    for _ in range(n):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        t = time.perf_counter()
        c.request("GET", "/health")
        c.getresponse().read()
        ts.append(time.perf_counter() - t)
        c.close()
    return statistics.median(ts)


def wait_health(port: int, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become ready")


def proxy_overhead(local: int, port: int, tokens: int) -> dict:
    """`vlmrt serve` and the 1-replica application, requests alternating under the same machine load."""
    pairs = [(stream(local, first_turn(20_000 + i), tokens), stream(port, first_turn(30_000 + i), tokens))
             for i in range(10)]
    return {"target": "proxy overhead: vlmrt serve vs Ray Serve 1 replica, alternating",
            "load_average_1m": os.getloadavg()[0], "health_rtt_s": [health_rtt(local), health_rtt(port)],
            "ttft_p50_s": [pct([x["ttft_s"] for x, _ in pairs], 50), pct([y["ttft_s"] for _, y in pairs], 50)],
            "answer_s_p50": [pct([x["total_s"] for x, _ in pairs], 50), pct([y["total_s"] for _, y in pairs], 50)],
            "levels": []}


def measure(port: int, a, label: str, plan) -> dict:
    wait_health(port)
    stream(port, first_turn(10_000), 4)  # warm
    out = {"target": label, "load_average_1m": os.getloadavg()[0], "health_rtt_s": health_rtt(port),
           "levels": [level(port, c, n, a.tokens, 100 * c) for c, n in plan]}
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16, help="answer tokens (ignore_eos; default 16)")
    ap.add_argument("--only-followups", action="store_true",
                    help="only the follow-ups' TTFT of each target (no throughput levels, no proxy overhead)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    served = ["--slots", str(a.slots), "--queue", "32", "--threads", "1"]
    plan = [] if a.only_followups else [(1, 6), (8, 16), (32, 32)]
    results = []
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    # `vlmrt serve` alone, one intra-op thread pinned to core 0 as the first replica is; up beside Ray's 1 replica, so
    # that the proxy's cost is measured request by request, alternating, under the same machine load
    local = ray_app.free_port("127.0.0.1")
    p = subprocess.Popen([sys.executable, "-m", "vlmrt.cli", "serve", a.bundle, "--port", str(local), *served,
                          "--log-level", "warning"], preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    ap2 = argparse.ArgumentParser()
    add_parser(ap2.add_subparsers())
    port = ray_app.free_port("127.0.0.1")
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, logging_level=logging.ERROR)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for replicas, router in ((1, "conversation"), (2, "conversation"), (2, "power of two choices")):
            args = ap2.parse_args(["serve", a.bundle, "--ray", "--replicas", str(replicas), "--pin-cores", *served])
            opts = {} if router == "conversation" else {"request_router_config": RequestRouterConfig()}
            serve.run(ray_app.application(args, a.bundle, **opts), name="bench", route_prefix="/", blocking=False)
            label = f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''} ({router} router)"
            if p is not None:
                wait_health(local)
                wait_health(port)
                if not a.only_followups:
                    results.append(proxy_overhead(local, port, a.tokens))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                results.append(measure(local, a, "vlmrt serve (--threads 1, core 0)", plan))
                results[-1]["followups"] = followups(local, 8, 4, 12, 500)
                p.terminate()
                p.wait(timeout=30)
                p = None
            r = measure(port, a, label, plan if router == "conversation" else [])
            r["followups"] = followups(port, 8, 4, 12, 500 + 50 * len(results))
            print(json.dumps(r["followups"]), file=sys.stderr, flush=True)
            results.append(r)
            serve.delete("bench")
    finally:
        if p is not None:
            p.terminate()
        serve.shutdown()
        ray.shutdown()
    if a.json:
        print(json.dumps(results))
        return 0
    for r in results:
        if "followups" not in r:
            print(f"{r['target']}: TTFT p50 {r['ttft_p50_s'][0]:.3f} vs {r['ttft_p50_s'][1]:.3f} s, an answer p50 "
                  f"{r['answer_s_p50'][0]:.3f} vs {r['answer_s_p50'][1]:.3f} s, GET /health "
                  f"{1000 * r['health_rtt_s'][0]:.1f} vs {1000 * r['health_rtt_s'][1]:.1f} ms")
            continue
        print(f"{r['target']}: GET /health {1000 * r['health_rtt_s']:.1f} ms")
        for lv in r["levels"]:
            print(f"  {lv['concurrency']:2d} concurrent ({lv['requests']} answers): {lv['tokens_per_s']:6.1f} tokens/s, "
                  f"TTFT p50 {lv['ttft_p50_s']:.3f} s p95 {lv['ttft_p95_s']:.3f} s")
        f = r["followups"]
        print(f"  follow-ups ({f['followups']}): TTFT p50 {f['ttft_p50_s']:.3f} s p95 {f['ttft_p95_s']:.3f} s, "
              f"{f['reused_mean']:.1f} prompt tokens reused on average, {f['cold']} cold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
