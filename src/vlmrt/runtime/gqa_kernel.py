"""Which of ORT's GroupQueryAttention CPU kernels a bundle's sessions run: chosen by the cache the decoder reads.

ORT 1.32's CPU GroupQueryAttention attends over the cache on one of two kernels, picked in each node's constructor
(when its session is built) from the environment variable ORT_GQA_DISABLE_FLASH_ATTENTION; no session option or node
attribute reaches it:
  flash   (ORT's default) the cache in blocks of the L2 cache's size under an online softmax, one task per query
          head (9 for SmolLM2) split statically over the threads (MlasFlashAttentionGQA, MlasFlashAttentionQuantizedKV)
  scores  a whole row of scores per query head, its softmax, then the rows of V (MlasQKGemm / MlasSVGemm, which read a
          quantized cache directly; sgemm on a float cache), the heads spread by the thread pool's cost model
Measured (docs/performance.md, "Decode at 4000: ORT's two attention kernels"): over an int8 or int4 cache `scores`
decodes in ~0.7x flash's time at every length (one layer at 4000 positions, 1 thread: int8 0.55 -> 0.38 ms, int4
0.65 -> 0.49 ms; the whole w4a8 decode step at 4000, 2 threads: 16.3 -> 13.4 ms) and prefills an int8 cache in the
same time; over a float cache `flash` is the faster (fp32 0.62 vs 0.85 ms). Both give the same outputs to float
rounding (7e-6 on outputs of ~6) and write the same cache bytes. `scores` holds a call's scores, [heads, rows,
max_context] float32: 20 MB for SmolLM2's 128-row prefill block at 4352 slots, +20 MB of peak RSS at 4000 tokens at that block
(flash: an L2-sized tile per thread). So the kernel follows the cache's dtype
(KERNEL_BY_CACHE); a decoder whose attention layers' caches would take different kernels keeps ORT's default. An
ORT_GQA_DISABLE_FLASH_ATTENTION the user set wins (ORT's own switch: benchmarks compare the kernels with it).

The kernel is ORT's per node, so one session's prefill and decode calls run on the same one (a second session of
the decoder would hold a second packed copy of its weights). What bounds `scores`' buffer is the rows of a call: a
decoder on it prefills in blocks of at most PREFILL_ROWS rows (the bundle's block if smaller; runtime/vlm.py
scheduler_for): 10 MB at 64 rows, the same prefill time as 128 (2 threads: 0.99-1.01x at cache positions 1000 and
4000; 32 rows: 1.02-1.08x) and a peak 14-21 MB lower at 4000 tokens (docs/performance.md "The scores kernel's buffer")."""

from __future__ import annotations

import contextlib
import os
import threading

from ..format import manifest as mf

ENV = "ORT_GQA_DISABLE_FLASH_ATTENTION"
KERNELS = {"flash": "0", "scores": "1"}  # name -> ENV's value while a session is built
KERNEL_BY_CACHE = {"float32": "flash", "float16": "flash", "int8": "scores", "uint8": "scores"}  # cache dtype -> kernel
DEFAULT = "flash"
# kernel -> the most rows one prefill call takes on it (None: the bundle's block, decoder.prefill_ar)
PREFILL_ROWS = {"flash": None, "scores": 64}
_LOCK = threading.Lock()  # the variable is the process's: one session is built at a time under it


def for_cache(kv: mf.KVSpec) -> str:
    """The kernel a decoder over kv's attention caches runs (KERNEL_BY_CACHE; DEFAULT for another dtype, without
    attention layers, or when the layers would take different kernels)."""
    kernels = {KERNEL_BY_CACHE.get(layer.cache_dtype(kv.dtype), DEFAULT) for layer in kv.attention()}
    return kernels.pop() if len(kernels) == 1 else DEFAULT


def running(kernel: str) -> str:
    """The kernel that sessions built for `kernel` (under building) run: the user's ENV, where set, wins (ORT reads
    it as a flag: "1" or "true" is scores)."""
    if ENV not in os.environ:
        return kernel
    return "scores" if os.environ[ENV].strip().lower() in ("1", "true") else "flash"


@contextlib.contextmanager
def building(kernel: str):
    """While an ORT session is built: ENV says the kernel's value (restored after), unless the user set ENV."""
    with _LOCK:
        if ENV in os.environ:
            yield
            return
        os.environ[ENV] = KERNELS[kernel]
        try:
            yield
        finally:
            os.environ.pop(ENV, None)
