"""Greedy answers of sequences decoding together (runtime/batch_engine.py) vs each alone: how often and where they part.

    python benchmarks/batch_answers.py BUNDLE [--batch 16] [--gen 96] [--threads 2]

BUNDLE: a bundle whose decoder takes a batch (decoder.kind.batched). --batch chat prompts (text) are answered alone
(one Engine, one-row decode steps) and then all together (one decoder call per step, every sequence started at
once), --gen tokens each (ignore_eos). Prints one JSON object: per sequence the first token index where the two
answers differ (null: identical), and the wall time of both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vlmrt.runtime.batch_engine import batched_vlms  # noqa: E402
from vlmrt.runtime.bundle import Bundle  # noqa: E402
from vlmrt.runtime.engine import STEP  # noqa: E402
from vlmrt.runtime.pipeline import VLM  # noqa: E402

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
    a = ap.parse_args()
    b = Bundle.open(a.bundle, threads=a.threads, verify=False)
    alone = VLM(b)
    ids = [alone.prompt(PROMPTS[i % len(PROMPTS)]).ids for i in range(a.batch)]
    e = alone.engine
    t = time.perf_counter()
    want = [list(e.generate(e.embed(x), max_new_tokens=a.gen, ignore_eos=True)) for x in ids]
    t_alone = time.perf_counter() - t
    vlms, batch = batched_vlms(b, a.batch)
    gens = [v.engine.generate(v.engine.embed(x), max_new_tokens=a.gen, ignore_eos=True) for v, x in zip(vlms, ids)]
    got = [[] for _ in ids]
    t = time.perf_counter()
    live = set(range(len(ids)))
    while live:
        for i in list(live):
            for y in gens[i]:
                if y is STEP:
                    break
                got[i].append(y)
            else:
                live.discard(i)
        batch.run()
    t_batch = time.perf_counter() - t
    first = [next((k for k, (x, y) in enumerate(zip(w, g)) if x != y), None) for w, g in zip(want, got)]
    print(json.dumps({"bundle": a.bundle, "precision": b.manifest.graphs["decode"].precision, "batch": a.batch,
                      "gen": a.gen, "threads": a.threads, "first_difference": first,
                      "identical": sum(f is None for f in first), "alone_s": round(t_alone, 2),
                      "together_s": round(t_batch, 2), "mean_rows_per_call": round(batch.rows / batch.calls, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
