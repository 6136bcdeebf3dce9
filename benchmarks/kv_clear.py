"""The per-prefill cost of KVCache.clear_unused (every slot a step does not see holds the reading graph's zero point,
runtime/kv_cache.py): the "clean from" mark (only slots written since the last clear, or the whole tail of a buffer
whose zero point changes) vs the full memset of the unused slots it replaced, side by side in one process.

    python benchmarks/kv_clear.py [--bundle HTP_BUNDLE] [--layers 28 --dim 1024 --max-context 4096]
                                  [--prompt 256] [--answer 64] [--calls 8]

A call is what Engine.prefill + generate do to the cache: reset, clear_unused(encoding of the graph that reads next),
the prompt's rows, in hybrid mode requantize(prefill -> decode) (which clears again, under decode's zero points), then
the answer's rows. Default shape: the InternVL3.5-1B decoder's (Qwen3-0.6B: 28 layers, 8 KV heads x 128) at 4k
context, 235 MB of uint8 cache; its per-layer encodings are made up, with a zero point differing between prefill and
decode in a third of the buffers (the real SmolLM2-135M HTP bundle: 21 of 30 keys and 19 of 30 values are equal);
--bundle takes the spec and encodings from an HTP bundle's manifest instead. Reported: thread CPU seconds per call in
clear_unused at the prefill and requantize (the rows' requantization included: the same work in both, and its
clear of the tail under decode's zero points), medians of --calls calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import numpy as np

from vlmrt.format import manifest as mf
from vlmrt.runtime.kv_cache import KVCache


class FullMemset(KVCache):
    """clear_unused as it was before the mark (session 9): every unused slot of every buffer, at every prefill."""

    def clear_unused(self, enc: dict) -> None:
        n = self.length
        for kind, bufs in (("key", self.keys), ("value", self.values)):
            for i, buf in enumerate(bufs):
                buf[n:] = enc[kind][i][1]


def made_up(layers: int, rng) -> dict:
    """Per-graph encodings {"prefill": {"key": [[s, zp], ...], ...}, "decode": ...}, zp differing in a third."""
    out = {"prefill": {}, "decode": {}}
    for kind in ("key", "value"):
        zp = rng.integers(90, 160, layers).astype(float)
        other = np.where(np.arange(layers) % 3 == 0, zp + 7, zp)
        out["prefill"][kind] = [[0.05, float(z)] for z in zp]
        out["decode"][kind] = [[0.04, float(z)] for z in other]
    return out


def per_call(cls, spec: mf.KVSpec, enc: dict, mode: str, prompt: int, answer: int, calls: int, rng):
    """Medians over calls of (clear_unused at the prefill, requantize) thread CPU seconds."""
    cache = cls(spec)
    rows = rng.integers(0, 256, (spec.layers, 2, prompt + answer, spec.dim), dtype=np.uint8)
    first = enc["prefill"] if mode == "hybrid" else enc["decode"]
    times = []
    for _ in range(calls + 1):  # the first call touches a fresh mapping's pages: not counted
        cache.reset()
        t = time.thread_time()
        cache.clear_unused(first)
        clear = time.thread_time() - t
        cache.write(rows[:, :, :prompt], prompt)
        t = time.thread_time()
        if mode == "hybrid":
            cache.requantize(enc["prefill"], enc["decode"])
        times.append((clear, time.thread_time() - t))
        cache.write(rows[:, :, prompt:], answer)
    return np.median(np.asarray(times[1:]), 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--calls", type=int, default=8)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    if a.bundle:
        raw = json.load(open(os.path.join(a.bundle, "manifest.json")))
        spec = mf.KVSpec(**{k: v for k, v in raw["kv"].items() if k in {f.name for f in dataclasses.fields(mf.KVSpec)}})
        enc = spec.encodings
    else:
        spec = mf.KVSpec(layers=a.layers, dim=a.dim, max_context=a.max_context, dtype="uint8", key_input="k{layer}",
                         value_input="v{layer}", key_output="nk{layer}", value_output="nv{layer}")
        enc = made_up(a.layers, rng)
    differ = sum(p[1] != d[1] for kind in ("key", "value") for p, d in zip(enc["prefill"][kind], enc["decode"][kind]))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"cache {spec.layers} layers x {spec.dim} x {spec.max_context} slots x 2 = "
          f"{2 * spec.layers * spec.dim * spec.max_context / 1e6:.0f} MB uint8; zero point differs between prefill and "
          f"decode in {differ} of {2 * spec.layers} buffers; prompt {a.prompt} + answer {a.answer} tokens per call")
    print(f"CPU {cpu}; load {open('/proc/loadavg').read().split()[:3]}")
    for mode in ("kv", "hybrid"):
        old = per_call(FullMemset, spec, enc, mode, a.prompt, a.answer, a.calls, rng)
        new = per_call(KVCache, spec, enc, mode, a.prompt, a.answer, a.calls, rng)
        print(f"{mode:6s}: full memset {1000 * old.sum():7.2f} ms (clear {1000 * old[0]:.2f} + requantize "
              f"{1000 * old[1]:.2f})  clean-from mark {1000 * new.sum():7.2f} ms (clear {1000 * new[0]:.2f} + "
              f"requantize {1000 * new[1]:.2f})  CPU per call, {old.sum() / max(new.sum(), 1e-9):.1f}x")


if __name__ == "__main__":
    main()
