"""How long a running answer waits while another request's image is encoded under continuous batching.

    python -m benchmarks.batch_image_stall BUNDLE [--image P] [--threads 2] [--tokens 200]

Two sequences over one bundle (runtime/decode/scheduler.py, run by the AnswerLoop that runs serve/scheduler.py's slots): sequence A
decodes a long answer; after A's 10th token, sequence B asks about the image. Prints, as one JSON object, A's
inter-token gaps before B arrived and while B's image was encoded and prefilled (median, max), B's tiles and the
time one vision call and the whole image take (the whole image's encode is what A waited in one stretch when a
round encoded a whole image: the scheduler before tile-by-tile rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from vlmrt.runtime.answers import AnswerLoop
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.vlm import VLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--image", default=str(Path(__file__).resolve().parents[1] / "tests/assets/chelsea.png"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    a = ap.parse_args()
    bundle = Bundle.open(a.bundle, threads=a.threads)
    va, vb = vlms = VLM.slots(bundle, 2)
    if not va.scheduler.batched:
        raise SystemExit("this bundle's decoder takes one sequence per call: nothing is batched")
    ask = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": a.image}},
                                        {"type": "text", "text": "What is in the image?"}]}]
    loop = AnswerLoop(vlms)
    loop.begin(va.chat_answer([{"role": "user", "content": "Write a long story about a lighthouse."}],
                              max_new_tokens=a.tokens, ignore_eos=True))
    stamps, b_from, b_first = [], None, None
    while loop.busy:
        for slot, kind, _ in loop.round():
            if kind != "piece":
                continue
            if slot == 0:
                stamps.append(time.perf_counter())
                if len(stamps) == 10:
                    loop.begin(vb.chat_answer(ask, max_new_tokens=4))
                    b_from = time.perf_counter()
            elif b_first is None:
                b_first = time.perf_counter()
    gaps = [y - x for x, y in zip(stamps, stamps[1:])]
    before = [g for x, g in zip(stamps[1:], gaps) if x <= b_from]
    during = [g for x, g in zip(stamps[1:], gaps) if b_from < x <= b_first]
    st = vb.result.stats
    p = vb.prompt(ask)
    chunk = next(c for c in p.chunks if getattr(c, "pixels", None) is not None)
    t = time.perf_counter()
    vb.encode_image(chunk.pixels[:1], None if chunk.patch_grids is None else chunk.patch_grids[:1])
    one = time.perf_counter() - t
    t = time.perf_counter()
    vb.encode_image(chunk.pixels, chunk.patch_grids)
    whole = time.perf_counter() - t
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    print(json.dumps({"bundle": a.bundle, "cpu": cpu, "threads": a.threads, "tiles": st.image_tiles,
                      "gap_before_ms": {"median": 1e3 * statistics.median(before), "max": 1e3 * max(before)},
                      "gap_while_b_encodes_ms": {"median": 1e3 * statistics.median(during), "max": 1e3 * max(during),
                                                 "tokens": len(during)},
                      "one_vision_call_ms": 1e3 * one, "whole_image_encode_ms": 1e3 * whole,
                      "b_ttft_s": st.ttft_s}, indent=1))


if __name__ == "__main__":
    main()
