"""transformers eager fp32 on the converted checkpoint: text prefill of N tokens, then exactly M greedy tokens.

    python hf_text.py CHECKPOINT THREADS PROMPT_TOKENS GEN_TOKENS
"""
import json
import resource
import sys
import time

import torch

ckpt, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
from transformers import AutoModelForImageTextToText, AutoTokenizer  # noqa: E402

t = time.perf_counter()
model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
tok = AutoTokenizer.from_pretrained(ckpt)
load = time.perf_counter() - t
ids = tok("The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. " * 200)["input_ids"][:n_prompt]
x = torch.tensor([ids])
with torch.no_grad():
    t = time.perf_counter()
    out = model(input_ids=x, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(n_gen - 1):
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    dec = time.perf_counter() - t
print(json.dumps({"load_s": load, "ttft_s": ttft, "prompt_tokens": len(ids), "decode_tokens_per_s": (n_gen - 1) / dec,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
