"""The host (Python) work of one decode step, each part timed alone (best of 5 x 2000 calls), on a bundle:
embedding lookup (into the step's input buffer), in-place inputs, KV write, greedy sampling, and the whole host
side of a decode step (CacheRow.step_token with session.run replaced by a no-op). Usage: python -m benchmarks.host_parts BUNDLE"""
import sys
import time

from vlmrt.runtime.decode.kv_cache import KVCache
from vlmrt.runtime.vlm import VLM
from vlmrt.runtime.decode.sampler import Sampler, SamplingConfig
from vlmrt.runtime.decode.step import make_step

vlm = VLM.load(sys.argv[1], threads=2, verify=False)
m, e = vlm.manifest, vlm.row
kind = e.kind
cache = KVCache(m.kv, kind.layout)
cache.length = 300
ctx = kind.context(300)
step = make_step(vlm.bundle.sessions["decode"], kind, cache, ctx=ctx, ar=1, io_dtype=e.dtype)
x = e.embed([5])
pos = e.positions(1)
step(x, pos, 300)
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
    "embed lookup (int8 row x scale, in place)": lambda: e.embedding.into(1234, step.buffers.embeds[0]),
    "inputs in place (positions, mask / end slot)": lambda: (step.buffers.load(step.buffers.embeds[:1], pos),
                                                             step.inputs.set(300)),
    "KV store (rows kinds: one copy of 60 rows)": lambda: (kind.store(cache, step.staged, 1, step.buffers.positions),
                                                           setattr(cache, "length", 300)),
    "greedy sampler (argmax 49280)": lambda: samp(step.buffers.logits[0]),
}
for k, f in parts.items():
    print(f"{k:45s} {t(f):7.1f} us")


class NoRun:  # the decode session with its graph call replaced: what is left is the host's part of a step
    def __init__(self, s):
        self.s = s

    def io_binding(self):
        return self.s.io_binding()

    def run_with_iobinding(self, io):
        pass

    def __getattr__(self, k):
        return getattr(self.s, k)


e.sessions.decode = NoRun(e.sessions.decode)
e._steps.clear()


def whole():
    e.cache.length = 300
    samp(e.step_token(1234))


print(f"{'whole decode step, host side (step_token + sampler)':45s} {t(whole):7.1f} us")
