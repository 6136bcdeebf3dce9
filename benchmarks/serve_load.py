"""`vlmrt serve` under load: requests/s and time to first token at 1, 4 and 16 concurrent clients, the follow-up
question's TTFT vs the first question's, and a soak (N clients for T seconds, the server's RSS sampled).

    python -m benchmarks.serve_load [BUNDLE] [--slots 4] [--levels 1,4,16] [--duration 20] [--followups 10]
    python -m benchmarks.serve_load --soak 600 --soak-clients 8 --only soak

Starts `vlmrt serve` (default: the offline demo model) as a subprocess on a free port and talks to it over loopback
HTTP like any client: streamed requests (TTFT = the first content chunk's arrival, queueing included), easy-VQA test
questions about their images (data URIs), 16 answer tokens at most, greedy. The soak mixes fresh questions, follow-ups
and 1 malformed request in 20 (expected: 400); every request must end answered (200) or refused (4xx / 503), anything
else (a 5xx, a dropped connection, a stream without [DONE]) is counted as lost. RSS: /proc/PID/status VmRSS every 5 s.
Prints one JSON object; --out FILE writes it too.

--only throughput (continuous batching, docs/server.md): at each --levels N, N clients send one streamed greedy
text request each of --gen tokens (ignore_eos), --rounds times; aggregate generated tokens/s over the wall time and
TTFT p50/p95. Servers, restarted per level with N slots (llama-server: -np N), in turn at each level: this tree's
`vlmrt serve BUNDLE`, each --against NAME=SRC (another vlmrt tree's src folder, e.g. main's before a change, on the
same bundle or NAME=SRC@BUNDLE) and --llama-server BIN with --gguf (the same weights):

    python -m benchmarks.serve_load B --only throughput --levels 1,4,8,16 --gen 96 --threads 2 \
        --against before=/tmp/main/src --llama-server /work/peers/bin/llama-server --gguf M.gguf
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


def stream(port: int, messages: list[dict], raw: bytes | None = None, timeout: float = 120, **fields) -> dict:
    """One streamed request: status, ttft_s, total_s, text, vlmrt timings; lost=True when it did not end properly.
    fields: more body fields (max_tokens: MAX_TOKENS unless given)."""
    body = raw if raw is not None else json.dumps({"messages": messages, "stream": True, "max_tokens": MAX_TOKENS,
                                                   **fields}).encode()
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
            if ev_.get("timings"):  # llama-server's last chunk
                out["timings"] = ev_["timings"]
            if ev_.get("usage"):
                out["usage"] = ev_["usage"]
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


PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk in a forest in autumn.", "What makes a good breakfast? Explain.",
           "Tell me about the history of paper.", "Describe the life of a honey bee.",
           "Explain why the sea is salty.", "Write a letter to a friend about a trip to the mountains."]


def throughput(port: int, clients: int, gen: int, rounds: int) -> dict:
    """clients concurrent streamed greedy requests of gen tokens each, rounds times."""
    results = []
    t0 = time.perf_counter()
    for r in range(rounds):
        with ThreadPoolExecutor(clients) as ex:
            results += list(ex.map(lambda k: stream(port, [{"role": "user", "content": PROMPTS[(k + r) % len(PROMPTS)]}],
                                                    max_tokens=gen, ignore_eos=True, temperature=0.0, timeout=600,
                                                    stream_options={"include_usage": True}),
                                   range(clients)))
    wall = time.perf_counter() - t0
    ok = [x for x in results if x["status"] == 200 and not x["lost"]]
    tokens = [x["usage"]["completion_tokens"] if x.get("usage") else x["timings"]["predicted_n"] for x in ok]
    ttft = [x["ttft_s"] for x in ok]
    return {"clients": clients, "requests": len(results), "ok": len(ok), "tokens": sum(tokens),
            "wall_s": round(wall, 2), "tokens_per_s": round(sum(tokens) / wall, 1),
            "ttft_p50_s": round(pct(ttft, 0.5), 3), "ttft_p95_s": round(pct(ttft, 0.95), 3)}


def start_llama(binary: str, gguf: str, slots: int, threads: int, ctx_per_slot: int = 1024):
    """llama-server -np slots on gguf (continuous batching is its default); --no-repack where the CPU needs it."""
    for extra in ([], ["--no-repack"]):  # (its default build dies on a CPU that reports AMX but faults on it)
        port = free_port()
        p = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "-np", str(slots), "-c",
                              str(ctx_per_slot * slots), "-t", str(threads), "-tb", str(threads), *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)})
        if wait_ready(p, port, then_warm=True):
            return p, port, bool(extra)
    raise SystemExit("llama-server did not start, with or without --no-repack")


def free_port() -> int:
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def wait_ready(p, port: int, then_warm: bool = False) -> bool:
    """Whether the server at port came up (and, then_warm, answered a short request) before its process ended."""
    for _ in range(1200):
        if p.poll() is not None:
            return False
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                if then_warm:
                    r = stream(port, [{"role": "user", "content": "hi"}], max_tokens=4)
                    if r["status"] != 200 or r["lost"]:
                        p.kill()
                        return False
                return True
        except OSError:
            pass
        time.sleep(0.1)
    p.kill()
    return False


def start_server(bundle: str | None, slots: int, mode: str | None, src: str | None = None, threads: int | None = None):
    """vlmrt serve (this tree's, or the vlmrt at src: another tree's src folder) on a free port."""
    cmd = [sys.executable, "-m", "vlmrt.cli", "serve", *([bundle] if bundle else []), "--port", "0", "--slots",
           str(slots), "--log-level", "warning", *(["--mode", mode] if mode else []),
           *(["--threads", str(threads)] if threads else [])]
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stderr.readline()
    while line and "serving" not in line:  # (warnings before the banner)
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


def throughput_main(a) -> int:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "cores": os.cpu_count(),
           "threads": a.threads, "gen": a.gen, "rounds": a.rounds, "bundle": a.bundle, "gguf": a.gguf,
           "loadavg_before": open("/proc/loadavg").read().split()[:3], "levels": []}
    servers = [("vlmrt", None, a.bundle)] + [(n, *(v.split("@", 1) if "@" in v else (v, a.bundle)))
                                             for n, v in (x.split("=", 1) for x in a.against)]
    for n in (int(x) for x in a.levels.split(",")):
        row = {"clients": n}
        for name, src, bundle in servers:
            p, port = start_server(bundle, n, a.mode, src, a.threads)
            try:
                throughput(port, 1, 8, 1)  # warm up
                row[name] = throughput(port, n, a.gen, a.rounds)
            finally:
                p.terminate()
                p.wait(30)
        if a.llama_server:
            p, port, out["llama_no_repack"] = start_llama(a.llama_server, a.gguf, n, a.threads or 2)
            try:
                throughput(port, 1, 8, 1)
                row["llama-server"] = throughput(port, n, a.gen, a.rounds)
            finally:
                p.terminate()
                p.wait(30)
        out["levels"].append(row)
        print(json.dumps(row), file=sys.stderr)
    out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


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
    ap.add_argument("--only", choices=["levels", "followups", "soak", "throughput"], action="append")
    ap.add_argument("--gen", type=int, default=96, help="throughput: tokens per request")
    ap.add_argument("--rounds", type=int, default=1, help="throughput: requests per client per level")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--against", action="append", default=[], metavar="NAME=SRC[@BUNDLE]")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    only = set(a.only or ["levels", "followups"])
    if only == {"throughput"}:
        return throughput_main(a)
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
