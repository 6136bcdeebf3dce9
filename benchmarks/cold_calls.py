"""What one Python / numpy call costs right after a pass over 100 MB (as after a decode step's graph call, which
streams the weights): the caches, TLB and branch predictors are cold then. Median of 60 of each, wall clock.
Usage: python benchmarks/cold_calls.py"""
import os
import statistics
import time

import numpy as np

big = np.ones(100_000_000 // 4, np.float32)
a, buf = np.zeros(4, np.int64), np.zeros(1, np.int32)
view = memoryview(a)


class O:
    pass


o = O()
o.x, o.y = 1, O()
o.y.z = 2
ns = time.perf_counter_ns
calls = {
    "nothing (two clock reads)": lambda: None,
    "three attribute reads": lambda: (o.y.z, o.x, o.y),
    "numpy scalar index a[0]": lambda: a[0],
    "numpy scalar store buf[0] = 5": lambda: buf.__setitem__(0, 5),
    "int(a[0])": lambda: int(a[0]),
    "memoryview item view[0]": lambda: view[0],
    "os.getpid() (a syscall)": os.getpid,
}
res = {k: [] for k in calls}
for _ in range(60):
    for k, f in calls.items():
        big.sum()  # stream 100 MB
        t = ns()
        f()
        res[k].append(ns() - t)
for k, v in res.items():
    print(f"{k:32s} median {statistics.median(v) / 1000:6.2f} us")
