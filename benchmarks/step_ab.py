"""Interleaved A/B of one decoder graph step across bundles, through the runtime's cache row (I/O binding included):
min and median over reps. Usage: [G=decode|prefill] [T=threads] [R=reps] [POS=300] [CLOCK=wall|thread]
python -m benchmarks.step_ab BUNDLE [BUNDLE ...]. CLOCK=thread with T=1 times the calling thread's CPU time (ORT runs a
1-thread session on it): what a step costs, much less moved by other processes than wall time on a loaded machine."""
import sys, time, statistics, numpy as np, os
from vlmrt.runtime.vlm import VLM
clock = time.thread_time if os.environ.get("CLOCK") == "thread" else time.perf_counter
graph = os.environ.get("G", "decode"); reps = int(os.environ.get("R", "15")); pos = int(os.environ.get("POS", "300"))
vlms = {b: VLM.load(b, threads=int(os.environ.get("T", "2")), verify=False) for b in sys.argv[1:]}
times = {b: [] for b in vlms}
for b, v in vlms.items():
    e = v.row; e.cache.length = pos
    ar = 1 if graph == "decode" else v.manifest.decoder.prefill_ar
    x = np.random.randn(ar, v.manifest.decoder.hidden_size).astype(np.float32) * 0.02
    for _ in range(3): e.cache.length = pos; e.step(graph, x)
for r in range(reps):
    for b, v in vlms.items():
        e = v.row; ar = 1 if graph == "decode" else v.manifest.decoder.prefill_ar
        x = np.random.randn(ar, v.manifest.decoder.hidden_size).astype(np.float32) * 0.02
        for _ in range(5):
            e.cache.length = pos
            t = clock(); e.step(graph, x); times[b].append(clock() - t)
for b, ts in times.items():
    print(f"{graph} {b:40s} min {1000*min(ts):7.2f} ms  median {1000*statistics.median(ts):7.2f} ms")
