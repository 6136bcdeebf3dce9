"""Greedy answers of sequences decoding together (runtime/decode/scheduler.py) vs each alone: how often and where they part.

    python -m benchmarks.batch_answers BUNDLE [--batch 16] [--gen 96] [--threads 2] [--min-rows N]

BUNDLE: a bundle whose decoder takes a batch (decoder.kind.batched). --batch chat prompts (text) are answered alone
(a scheduler of one row, one-row decode steps), then each alone through the batch (row 0 of the batch's scheduler, the others idle:
a server's request sent alone) and then all together (one decoder call per step, every sequence started at once),
--gen tokens each (ignore_eos). Prints one JSON object: per sequence the first token index where the answer together
differs from the one-row engine's (first_difference) and from the one alone through the batch
(first_difference_batch_alone; null: identical), the batch's probe (Scheduler.probe) and the wall times.
--min-rows N overrides the probe's call width (1: every call as wide as its rows, as before the probe).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.vlm import VLM
from vlmrt.runtime.decode.sequence import Sequence

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk in a forest in autumn.", "What makes a good breakfast? Explain.",
           "Tell me about the history of paper.", "Describe the life of a honey bee.",
           "Explain why the sea is salty.", "Write a letter to a friend about a trip to the mountains.",
           "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Why is the sky blue?", "Name a famous painter.", "What is 12 times 7?", "Describe a cat in one line.",
           "Tell me a joke about computers."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-rows", type=int)
    a = ap.parse_args()
    b = Bundle.open(a.bundle, threads=a.threads, verify=False)
    alone = VLM(b)
    ids = [alone.prompt(PROMPTS[i % len(PROMPTS)]).ids for i in range(a.batch)]
    e = alone.scheduler
    t = time.perf_counter()
    want = [list(e.generate(e.embed(x), max_new_tokens=a.gen, ignore_eos=True)) for x in ids]
    t_alone = time.perf_counter() - t
    sched = VLM.slots(b, a.batch)[0].scheduler
    if a.min_rows:
        sched.min_rows = a.min_rows
    t = time.perf_counter()
    solo = [list(sched.generate(sched.embed(x), max_new_tokens=a.gen, ignore_eos=True, row=0)) for x in ids]
    t_solo = time.perf_counter() - t
    sched.calls = sched.rows_decoded = 0
    t = time.perf_counter()
    seqs = [sched.add(Sequence(sched.embed(x), max_new_tokens=a.gen, ignore_eos=True), i) for i, x in enumerate(ids)]
    while sched.running:
        sched.step()
    got = [s.ids for s in seqs]
    t_batch = time.perf_counter() - t

    def parts(ref):
        return [next((k for k, (x, y) in enumerate(zip(w, g)) if x != y), None) for w, g in zip(ref, got)]

    first, first_solo = parts(want), parts(solo)
    print(json.dumps({"bundle": a.bundle, "precision": b.manifest.graphs["decode"].precision, "batch": a.batch,
                      "gen": a.gen, "threads": a.threads, "cpu": _cpu(), "probe": sched.probed,
                      "min_rows": sched.min_rows, "first_difference": first,
                      "identical": sum(f is None for f in first), "first_difference_batch_alone": first_solo,
                      "identical_batch_alone": sum(f is None for f in first_solo), "alone_s": round(t_alone, 2),
                      "batch_alone_s": round(t_solo, 2),
                      "together_s": round(t_batch, 2), "mean_rows_per_call": round(sched.rows_decoded / sched.calls, 2)}))
    return 0


def _cpu() -> str:
    """The CPU's model name and the int8 ISA ORT's MLAS sees (cpuid as this process sees it: benchmarks/avx2-only
    hides AVX-512 and VNNI)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as f
    except ImportError:  # (numpy 1)
        from numpy.core._multiarray_umath import __cpu_features__ as f

    info = open("/proc/cpuinfo").read()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    isa = ("AVX-512 VNNI" if f.get("AVX512VNNI") else "AVX-VNNI" if " avx_vnni" in info
           else "AVX-512" if f.get("AVX512F") else "AVX2")
    return f"{name} ({isa})"


if __name__ == "__main__":
    sys.exit(main())
