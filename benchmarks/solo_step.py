"""What padding a sequence alone to a 2-row call costs (Scheduler.min_rows, set by the probe where one-row calls
round apart from multi-row ones): its decode step through the batch as a one-row call vs padded with an idle row,
interleaved, at cache length --pos (the idle row's too: a slot keeping its last conversation).

    python -m benchmarks.solo_step BUNDLE [--slots 8] [--threads 2] [--reps 40] [--pos 100] [--clock wall|thread]

--clock thread with --threads 1 times the calling thread's CPU time (ORT runs a 1-thread session on it): what a step
costs, much less moved by other processes than wall time on a loaded machine. Prints one JSON object: the probe's
findings and wall time (run again after load), the CPU (and the ISA its cpuid shows: benchmarks/avx2-only), min and
median ms per width and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.batch_answers import _cpu
from vlmrt.runtime.bundle import Bundle
from vlmrt.runtime.vlm import VLM


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--pos", type=int, default=100)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    a = ap.parse_args()
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    b = Bundle.open(a.bundle, threads=a.threads, verify=False)
    sched = VLM.slots(b, a.slots)[0].scheduler
    t = time.perf_counter()
    probed = dict(sched.probe())  # (again, its calls' shapes warm now: what a probe at load costs past the first call)
    probe_s = time.perf_counter() - t
    c = sched.rows[0].cache
    c.length = a.pos  # (rows of zeros: the step's cost does not depend on their values)
    sched.rows[1].cache.length = a.pos  # the idle row: a slot keeping its last conversation's rows (prefix reuse)
    token = sched.embedding.vocab // 2
    times: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(a.reps + 3):
        for rows in (1, 2):
            sched.min_rows = rows
            t = clock()
            sched.batch_call({0: token})
            dt = clock() - t
            c.rewind(a.pos)
            if rep >= 3:  # (warm-up)
                times[rows].append(dt)
    out = {"bundle": a.bundle, "precision": b.manifest.graphs["decode"].precision, "cpu": _cpu(), "threads": a.threads,
           "clock": a.clock, "pos": a.pos, "reps": a.reps, "probe": probed,
           "probe_s": round(probe_s, 3)}
    for rows, ts in times.items():
        out[f"rows_{rows}_ms"] = {"min": round(1000 * min(ts), 2), "median": round(1000 * statistics.median(ts), 2)}
    out["padded_vs_one_row_median"] = round(out["rows_2_ms"]["median"] / out["rows_1_ms"]["median"], 3)
    out["padded_vs_one_row_min"] = round(out["rows_2_ms"]["min"] / out["rows_1_ms"]["min"], 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
