"""What log probabilities cost a decode: one answer's decode tokens/s without logprobs, with logprobs=0 (the token's
own) and with logprobs=20 (OpenAI's most top_logprobs), interleaved run by run; and token_logprobs alone on one
logits row of the bundle's vocabulary (the host work a sequence that asks adds per token).

    python -m benchmarks.logprobs_cost BUNDLE [--tokens 96] [--reps 7] [--threads 1]

Greedy, ignore_eos, one text prompt, a VLM of one row (one stream). Prints one JSON object: the CPU, the medians
and every run's decode tokens/s per setting, their ratios, the calling thread's CPU time per generated token (with
--threads 1 ORT runs the graph on it: what a token costs, much less moved by other processes than wall time on a
loaded machine), and µs per token_logprobs call (median of 200).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from benchmarks.batch_answers import _cpu
from vlmrt.runtime.decode.logprobs import token_logprobs
from vlmrt.runtime.vlm import VLM

SETTINGS = {"off": None, "logprobs_0": 0, "logprobs_20": 20}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    vlm = VLM.load(a.bundle, threads=a.threads, verify=False)
    prompt = "Write a long story about a lighthouse keeper and the sea."
    runs: dict[str, list[float]] = {k: [] for k in SETTINGS}
    cpu_ms: dict[str, list[float]] = {k: [] for k in SETTINGS}
    answers = {}
    for rep in range(a.reps + 1):
        for name, lp in SETTINGS.items():
            t = time.thread_time()
            r = vlm(prompt, max_new_tokens=a.tokens, ignore_eos=True, logprobs=lp)
            cpu = time.thread_time() - t
            answers[name] = r.token_ids
            if rep:  # (the first round warms up)
                runs[name].append(r.stats.decode_tokens_per_s)
                cpu_ms[name].append(1000 * cpu / a.tokens)
    assert answers["off"] == answers["logprobs_0"] == answers["logprobs_20"]
    vocab = vlm.scheduler.embedding.vocab
    row = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    per_call = {}
    for top in (0, 20):
        ts = []
        for _ in range(200):
            t = time.thread_time()
            token_logprobs(row, 5, top)
            ts.append(time.thread_time() - t)
        per_call[f"top_{top}_us"] = round(1e6 * statistics.median(ts), 1)
    med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    cpu = {k: round(statistics.median(v), 3) for k, v in cpu_ms.items()}
    out = {"bundle": a.bundle, "precision": vlm.manifest.graphs["decode"].precision, "vocab": vocab, "cpu": _cpu(),
           "threads": a.threads, "tokens": a.tokens, "reps": a.reps, "decode_tokens_per_s_median": med,
           "ratio_to_off": {k: round(v / med["off"], 3) for k, v in med.items()},
           "thread_cpu_ms_per_token_median": cpu, "cpu_ratio_to_off": {k: round(v / cpu["off"], 3) for k, v in cpu.items()},
           "token_logprobs_thread_time": per_call, "runs": {k: [round(x, 2) for x in v] for k, v in runs.items()}}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
