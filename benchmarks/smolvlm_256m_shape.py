"""Export + run timing for a SmolVLM-256M-shaped random checkpoint (real config sizes) on this machine.

    python benchmarks/smolvlm_256m_shape.py [--work DIR]

Builds the checkpoint with transformers (test dependency), then times `vlmrt export` and
`vlmrt run` (both modes) as a user would run them, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# HuggingFaceTB/SmolVLM-256M-Instruct config.json sizes
TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, vocab_size=49280, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512, patch_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-bench-256m")
    ap.add_argument("--image", default=str(ROOT / "tests/assets/chelsea.png"))
    a = ap.parse_args()
    work = Path(a.work)
    ckpt, bundle = work / "ckpt", work / "bundle"
    if not (ckpt / "model.safetensors").exists():
        from fixtures import make_smolvlm_checkpoint

        make_smolvlm_checkpoint(ckpt, tie_word_embeddings=False, tile_size=512, patch_size=16, scale_factor=4,
                                longest_edge_tiles=4, text_layers=30, vision_layers=12,
                                text_overrides=TEXT, vision_overrides=VISION)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vlmrt.cli", "export", str(ckpt), str(bundle), "--force"], check=True)
    export_s = time.perf_counter() - t
    size = sum(p.stat().st_size for p in bundle.iterdir()) / 1e6
    print(f"export: {export_s:.1f} s, bundle {size:.0f} MB")
    for mode in ("hybrid", "kv"):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "run", str(bundle), "--image", a.image, "--prompt",
                            "Describe this image.", "--max-new-tokens", "32", "--ignore-eos", "--mode", mode, "--json"],
                           check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t
        s = json.loads(p.stdout.strip().splitlines()[-1])["stats"]
        print(f"run --mode {mode}: wall {wall:.1f} s | prompt {s['prompt_tokens']} tokens, {s['image_tiles']} tiles | "
              f"load {s['load_s']:.2f} s, preprocess {s['preprocess_s']:.3f} s, vision {s['vision_s']:.2f} s, "
              f"TTFT {s['ttft_s']:.2f} s, prefill {s['prefill_tokens_per_s']:.0f} tok/s, "
              f"decode {s['decode_tokens_per_s']:.1f} tok/s, peak RSS {s['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
