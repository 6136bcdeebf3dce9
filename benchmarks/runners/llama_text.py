"""llama.cpp (llama-cpp-python) on a GGUF: text prefill of N tokens, then exactly M greedy tokens. One JSON line.

    python llama_text.py GGUF THREADS PROMPT_TOKENS GEN_TOKENS
"""
import json
import resource
import sys
import time

import numpy as np
import llama_no_repack  # noqa: F401 (VLMRT_LLAMA_NO_REPACK)
from llama_cpp import Llama

gguf, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
load = time.perf_counter() - t
words = ("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. " * 200).encode()
prompt = llm.tokenize(words)[:n_prompt]
llm.reset()
t = time.perf_counter()
llm.eval(prompt)
tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
ttft = time.perf_counter() - t
t = time.perf_counter()
for _ in range(n_gen - 1):
    llm.eval([tok])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
dec = time.perf_counter() - t
print(json.dumps({"load_s": load, "ttft_s": ttft, "prompt_tokens": len(prompt), "decode_tokens_per_s": (n_gen - 1) / dec,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
