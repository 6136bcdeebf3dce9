"""`vlmrt serve` under load: requests/s and time to first token at 1, 4 and 16 concurrent clients, the follow-up
question's TTFT vs the first question's, and a soak (N clients for T seconds, the server's RSS sampled).

    python benchmarks/serve_load.py [BUNDLE] [--slots 4] [--levels 1,4,16] [--duration 20] [--followups 10]
    python benchmarks/serve_load.py --soak 600 --soak-clients 8 --only soak

Starts `vlmrt serve` (default: the offline demo model) as a subprocess on a free port and talks to it over loopback
HTTP like any client: streamed requests (TTFT = the first content chunk's arrival, queueing included), easy-VQA test
questions about their images (data URIs), 16 answer tokens at most, greedy. The soak mixes fresh questions, follow-ups
and 1 malformed request in 20 (expected: 400); every request must end answered (200) or refused (4xx / 503), anything
else (a 5xx, a dropped connection, a stream without [DONE]) is counted as lost. RSS: /proc/PID/status VmRSS every 5 s.
Prints one JSON object; --out FILE writes it too.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlmrt.demo import easyvqa_data as ev

MAX_TOKENS = 16


def questions(n: int = 260) -> list[tuple[str, str, str]]:
    """(question, expected answer, image data URI) from the easy-VQA test split."""
    out = []
    for q, a, image_id in ev.select("test", limit=n):
        data = base64.b64encode(ev.image_path("test", image_id).read_bytes()).decode()
        out.append((q, a, "data:image/png;base64," + data))
    return out


def user(text: str, image: str | None = None) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image}}] if image else []
    return {"role": "user", "content": parts + [{"type": "text", "text": text}]}


def stream(port: int, messages: list[dict], raw: bytes | None = None, timeout: float = 120) -> dict:
    """One streamed request: status, ttft_s, total_s, text, vlmrt timings; lost=True when it did not end properly."""
    body = raw if raw is not None else json.dumps({"messages": messages, "stream": True, "max_tokens": MAX_TOKENS}).encode()
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    out = {"status": None, "ttft_s": None, "text": "", "vlmrt": None, "lost": False}
    try:
        c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200:
            json.loads(r.read())["error"]  # a JSON error body, or lost
            out["lost"] = r.status >= 500 and r.status != 503
            return out
        done = False
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                break
            ev_ = json.loads(line[6:])
            if ev_.get("vlmrt"):
                out["vlmrt"] = ev_["vlmrt"]
            delta = ev_["choices"][0]["delta"] if ev_.get("choices") else {}
            if delta.get("content"):
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - t0
                out["text"] += delta["content"]
        out["lost"] = not done
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        out["lost"], out["error"] = True, repr(e)
    finally:
        c.close()
        out["total_s"] = time.perf_counter() - t0
    if out["ttft_s"] is None:
        out["ttft_s"] = out["total_s"]
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def level(port: int, clients: int, duration: float, qs) -> dict:
    """clients threads, each asking questions back to back for duration seconds."""
    stop = time.perf_counter() + duration
    results, lock = [], threading.Lock()

    def client(k: int):
        rng = random.Random(k)
        while time.perf_counter() < stop:
            q, a, image = rng.choice(qs)
            r = stream(port, [user(q, image)])
            r["correct"] = ev.normalize_answer(r["text"]) == a
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200 and not r["lost"]]
    ttft = [r["ttft_s"] for r in ok]
    return {"clients": clients, "requests": len(results), "ok": len(ok), "wall_s": round(wall, 1),
            "requests_per_s": round(len(ok) / wall, 2), "ttft_p50_s": round(pct(ttft, 0.5), 3),
            "ttft_p95_s": round(pct(ttft, 0.95), 3), "latency_p50_s": round(pct([r["total_s"] for r in ok], 0.5), 3),
            "queue_p50_s": round(pct([r["vlmrt"]["queue_s"] for r in ok if r["vlmrt"]], 0.5), 3),
            "accuracy": round(sum(r["correct"] for r in ok) / max(1, len(ok)), 3)}


SYSTEM = ("You are a careful assistant for questions about simple pictures of one shape. Each picture shows one shape, "
          "a circle, a rectangle or a triangle, in one color. Answer with one word.")


def followups(port: int, n: int, qs, system: bool = False) -> dict:
    """n conversations one after another: a question about a new image, then a follow-up about the same image
    (system: both after a system message, so that the first prompt spans full prefill blocks)."""
    pairs = []
    for i in range(n):
        q, _, image = qs[(7 * i) % len(qs)]
        first = ([{"role": "system", "content": SYSTEM}] if system else []) + [user(q, image)]
        r1 = stream(port, first)
        r2 = stream(port, first + [{"role": "assistant", "content": r1["text"]}, user("What color is the shape?")])
        pairs.append((r1, r2))
    f, s = [p[0]["ttft_s"] for p in pairs], [p[1]["ttft_s"] for p in pairs]
    return {"conversations": n, "system_message": system, "first_ttft_p50_s": round(statistics.median(f), 4),
            "followup_ttft_p50_s": round(statistics.median(s), 4),
            "ratio_p50": round(statistics.median(b / a for a, b in zip(f, s)), 3),
            "first_prompt_tokens": pairs[0][0]["vlmrt"]["prompt_tokens"],
            "followup_prompt_tokens": pairs[0][1]["vlmrt"]["prompt_tokens"],
            "followup_reused_tokens_p50": statistics.median(p[1]["vlmrt"]["reused_prompt_tokens"] for p in pairs),
            "followup_images_cached": sum(p[1]["vlmrt"]["images_cached"] for p in pairs)}


def rss_mb(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024


def soak(port: int, pid: int, clients: int, duration: float, qs) -> dict:
    stop = time.perf_counter() + duration
    counts, lock, samples, lost = {}, threading.Lock(), [], []

    def client(k: int):
        rng = random.Random(100 + k)
        conv = []
        while time.perf_counter() < stop:
            q, _, image = rng.choice(qs)
            roll = rng.random()
            if roll < 0.05:
                r = stream(port, [], raw=json.dumps({"messages": [user(q, "data:image/png;base64,@@")]}).encode())
            elif conv and roll < 0.4 and len(conv) < 6:  # a follow-up in this client's conversation
                conv += [user(q)]
                r = stream(port, conv)
                conv += [{"role": "assistant", "content": r["text"]}]
            else:
                conv = [user(q, image)]
                r = stream(port, conv)
                conv += [{"role": "assistant", "content": r["text"]}]
            key = "lost" if r["lost"] else str(r["status"])
            with lock:
                counts[key] = counts.get(key, 0) + 1
                if r["lost"]:
                    lost.append(r.get("error") or r["status"])
            if r["lost"] or r["status"] != 200:
                conv = []

    def sampler():
        t0 = time.perf_counter()
        while time.perf_counter() < stop:
            samples.append((round(time.perf_counter() - t0, 1), round(rss_mb(pid), 1)))
            time.sleep(5)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    th.join()
    rss = [m for _, m in samples]
    n = len(rss)
    return {"clients": clients, "duration_s": duration, "counts": counts, "lost": lost[:10],
            "rss_mb": {"first": rss[0], "min": min(rss), "max": max(rss), "last": rss[-1],
                       "first_minute_max": max(rss[: max(1, n // 10)]), "last_minute_max": max(rss[-max(1, n // 10):])},
            "rss_samples": samples}


def start_server(bundle: str | None, slots: int, mode: str | None):
    cmd = [sys.executable, "-m", "vlmrt.cli", "serve", *([bundle] if bundle else []), "--port", "0", "--slots",
           str(slots), "--log-level", "warning", *(["--mode", mode] if mode else [])]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    m = re.search(r"127\.0\.0\.1:(\d+)/", line)
    if not m:
        p.kill()
        raise SystemExit(f"the server did not start: {line}{p.stderr.read()}")
    port = int(m.group(1))
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in p.stderr], daemon=True).start()
    for _ in range(1200):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p, port
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit("the server did not become ready in 120 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None, help="default: the offline demo model")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--mode", choices=["kv", "hybrid"], default=None)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--duration", type=float, default=20, help="seconds per concurrency level")
    ap.add_argument("--followups", type=int, default=10)
    ap.add_argument("--soak", type=float, default=600)
    ap.add_argument("--soak-clients", type=int, default=8)
    ap.add_argument("--only", choices=["levels", "followups", "soak"], action="append")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    only = set(a.only or ["levels", "followups"])
    qs = questions()
    p, port = start_server(a.bundle, a.slots, a.mode)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
           "loadavg_before": open("/proc/loadavg").read().split()[:3], "slots": a.slots, "mode": a.mode or "bundle's",
           "max_tokens": MAX_TOKENS}
    try:
        stream(port, [user(*qs[0][::2])])  # warm up
        if "levels" in only:
            out["levels"] = [level(port, int(n), a.duration, qs) for n in a.levels.split(",")]
        if "followups" in only:
            out["followups"] = followups(port, a.followups, qs)
            out["followups_system"] = followups(port, a.followups, qs, system=True)
        if "soak" in only:
            out["soak"] = soak(port, p.pid, a.soak_clients, a.soak, qs)
        out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
        out["server_rss_mb"] = round(rss_mb(p.pid), 1)
    finally:
        p.terminate()
        p.wait(30)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
