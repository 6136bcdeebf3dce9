"""The host (Python) work of one decode step, each part timed alone (best of 5 x 2000 calls), on a bundle:
embedding lookup, in-place inputs, KV write, greedy sampling. Usage: python benchmarks/host_parts.py BUNDLE"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vlmrt.runtime.kv_cache import KVCache  # noqa: E402
from vlmrt.runtime.pipeline import VLM  # noqa: E402
from vlmrt.runtime.sampler import Sampler, SamplingConfig  # noqa: E402
from vlmrt.runtime.step import make_step  # noqa: E402

vlm = VLM.load(sys.argv[1], threads=2, verify=False)
m, e = vlm.manifest, vlm.engine
cache = KVCache(m.kv)
cache.length = 300
step = make_step(vlm.bundle.sessions["decode"], m.decoder, cache, ctx=320, ar=1, io_dtype=e.dtype)
x = e.embed([5])
step(x, 300)
N = 2000


def t(f):
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(N):
            f()
        best = min(best, (time.perf_counter() - s) / N)
    return best * 1e6


samp = Sampler(SamplingConfig())
parts = {
    "embed lookup (int8 row x scale)": lambda: e.embed([1234]),
    "inputs in place (embeds, positions, mask)": lambda: step.buffers.load(x, 300, step.mask, step.ctx, step.neg),
    "KV write (one copy of 60 rows)": lambda: (cache.write(step.rows, 1), setattr(cache, "length", 300)),
    "greedy sampler (argmax 49280)": lambda: samp(step.buffers.logits[0]),
}
for k, f in parts.items():
    print(f"{k:45s} {t(f):7.1f} us")
