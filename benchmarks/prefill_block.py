"""What a prompt's prefill costs per block size at a cache position: the same 128 prompt rows written from slot --pos
as one block of 128, two of 64, four of 32 (...), through the runtime's CacheRow, the blocks interleaved, min and
median of --reps. Each block is its own view of the bundle (its manifest's prefill_ar set to it, as
benchmarks/long_prompts.py's arms), so every block size runs its bound step, as a prompt's does.

    python -m benchmarks.prefill_block BUNDLE [--blocks 128,64,32] [--pos 1000,4000] [--reps 5] [--threads 2]
        [--clock wall|thread] [--work DIR]

--clock thread with --threads 1: the calling thread's CPU time (ORT runs a 1-thread session on it), much less moved by
other processes than wall time on a loaded machine. The cache's rows before --pos are zeros (attention's cost does not
depend on their values). Prints one JSON line per position: ms per 128 rows per block, and its ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.long_prompts import with_block
from vlmrt.runtime.vlm import VLM

ROWS = 128


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--blocks", default="128,64,32")
    ap.add_argument("--pos", default="1000,4000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--work", default=None, help="where the views go (default: beside the bundle)")
    a = ap.parse_args()
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    bundle = Path(a.bundle).resolve()
    work = Path(a.work) if a.work else bundle.parent / "prefill-block-views"
    blocks = [int(b) for b in a.blocks.split(",")]
    rows = {b: VLM.load(with_block(bundle, b, work), threads=a.threads, verify=False).row for b in blocks}
    hidden = next(iter(rows.values())).dec.hidden_size
    embeds = (np.random.default_rng(0).standard_normal((ROWS, hidden)) * 0.02).astype(np.float32)
    for pos in (int(p) for p in a.pos.split(",")):
        times: dict[int, list[float]] = {b: [] for b in blocks}
        for rep in range(a.reps + 1):
            for b in blocks:
                row = rows[b]
                row.cache.length = pos
                t = clock()
                for i in range(0, ROWS, b):
                    row.step("prefill", embeds[i : i + b])
                dt = clock() - t
                row.cache.rewind(pos)
                if rep:  # (the first round warms each block's shapes)
                    times[b].append(dt)
        out = {"bundle": str(bundle), "pos": pos, "threads": a.threads, "clock": a.clock, "reps": a.reps}
        for b in blocks:
            out[f"block_{b}_ms"] = {"min": round(1000 * min(times[b]), 1),
                                    "median": round(1000 * statistics.median(times[b]), 1)}
            out[f"block_{b}_vs_{blocks[0]}_median"] = round(statistics.median(times[b]) / statistics.median(times[blocks[0]]), 3)
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
