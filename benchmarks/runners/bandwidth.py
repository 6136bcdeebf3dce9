"""Memory bandwidth of this machine as a decoder sees it, T threads each on its share of a 512 MB buffer,
best of 5: read (sum) and copy (read + write, counted twice). The larger is the bound used for a decode
step, which reads every weight once.

    python bandwidth.py THREADS
"""
import json
import sys
import threading
import time

import numpy as np

threads = int(sys.argv[1])
a = np.ones(512 * 1024 * 1024 // 4, dtype=np.float32)
parts = np.array_split(a, threads)
b = np.empty_like(a)
outs = np.array_split(b, threads)


def timed(fn, args, nbytes):
    best = 0.0
    for _ in range(5):
        ts = [threading.Thread(target=fn, args=x) for x in args]  # numpy releases the GIL in these loops
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


read = timed(np.add.reduce, [(p,) for p in parts], a.nbytes)
copy = timed(np.copyto, list(zip(outs, parts)), 2 * a.nbytes)
print(json.dumps({"bytes_per_s": max(read, copy), "read_bytes_per_s": read, "copy_bytes_per_s": copy}))
