"""The host (Python) work of one decode step, each part timed alone (best of 5 x 2000 calls), on a bundle:
embedding lookup, in-place inputs, KV write, greedy sampling. Usage: python benchmarks/host_parts.py BUNDLE"""
import sys, time, numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
from vlmrt.runtime.pipeline import VLM
from vlmrt.runtime.kv_cache import attention_mask
vlm = VLM.load(sys.argv[1], threads=2, verify=False)
e = vlm.engine; e.cache.length = 300
x = e.embed([5]); e._step("decode", x, 1)
step = next(iter(e._bound.values()))
N = 2000
def t(f):
    best = 1e9
    for _ in range(5):
        s = time.perf_counter()
        for _ in range(N): f()
        best = min(best, (time.perf_counter() - s) / N)
    return best * 1e6
from vlmrt.runtime.sampler import Sampler, SamplingConfig
samp = Sampler(SamplingConfig())
parts = {
 "embed lookup (int8 row x scale)": lambda: e.embed([1234]),
 "inputs in place (embeds, positions, mask)": lambda: (step.embeds.__setitem__(slice(0, 1), x), np.add(step._range, 300, out=step.positions), attention_mask(300, 1, step.ctx, step.mask.dtype, out=step.mask)),
 "KV write (one copy of 60 rows)": lambda: (e.cache.write_block(step.rows, 1), setattr(e.cache, "length", 300)),
 "greedy sampler (argmax 49280)": lambda: samp(step.logits[0]),
}
for k, f in parts.items(): print(f"{k:45s} {t(f):7.1f} us")
