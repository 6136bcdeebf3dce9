"""Host time per decode step as CPU time, for a loaded machine: the runtime's clocks (scheduler.py / cache_row.py /
step.py time.perf_counter) read the calling thread's CPU time instead, and the session runs 1 intra-op thread (on the
calling thread), so GenerationStats.host_overhead_ms_per_step is the CPU time the host spends per step outside the
graph call — what `vlmrt bench` reports in wall time, much less moved by other processes. Rounds are interleaved
across bundles; medians. Usage: python -m benchmarks.host_time BUNDLE [BUNDLE ...] [--rounds 5] [--tokens 64]"""
import argparse
import statistics
import time
import types

from vlmrt.runtime.decode import cache_row as row_mod
from vlmrt.runtime.decode import scheduler as sched_mod
from vlmrt.runtime.decode import step as step_mod
from vlmrt.runtime.vlm import VLM

clock = types.SimpleNamespace(perf_counter=time.thread_time)
sched_mod.time = row_mod.time = step_mod.time = clock

ap = argparse.ArgumentParser()
ap.add_argument("bundles", nargs="+")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--prompt-tokens", type=int, default=256)
a = ap.parse_args()
vlms = {b: VLM.load(b, threads=1, verify=False) for b in a.bundles}
host = {b: [] for b in vlms}
step = {b: [] for b in vlms}
for r in range(a.rounds + 1):
    for b, v in vlms.items():
        e = v.scheduler
        x = e.embed(list(range(1000, 1000 + a.prompt_tokens)))
        for _ in e.generate(x, max_new_tokens=a.tokens, ignore_eos=True):
            pass
        if r:  # round 0 warms up
            host[b].append(e.last.host_overhead_ms_per_step)
            step[b].append(1000 * e.last.decode_s / len(e.last.step_times))
for b in vlms:
    print(f"{b:40s} host CPU ms/step median {statistics.median(host[b]):.4f} (min {min(host[b]):.4f})  "
          f"whole step CPU ms median {statistics.median(step[b]):.2f}")
