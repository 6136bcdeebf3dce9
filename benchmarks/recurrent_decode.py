"""Decode step time against the position (issue 46 item 5): Qwen3.5-shaped (Gated DeltaNet + gated attention, 3:1)
beside Qwen3-VL-2B-shaped (attention only) decoders at reduced depth, one decode step timed at cache lengths 100,
1000 and 4000.

    python -m benchmarks.recurrent_decode [--work DIR] [--depth 4] [--quant w4a16] [--steps 32]

Each checkpoint has the released widths and heads (Qwen3.5-0.8B / 2B as in their hub configs; Qwen3-VL-2B as
benchmarks/qwen_shapes.py), `--depth` decoder layers (Qwen3.5: the released pattern, every fourth layer full
attention), a vocabulary of 32768 (the released 248320 / 151936 would add the same lm-head time at every position),
a one-block vision tower and fixtures_qwen's tokenizer and processor files; transformers' random init. Each is exported
with `--quant`, loaded with the runtime, and a decode step (CacheRow.decode_token) is timed from cache length p on:
the cache's rows below p are zeros (what a step at p reads costs the same whatever they hold), the recurrent state
fixed-size whatever p; the positions interleaved over 4 rounds of `--steps` steps, the fastest step kept (a shared
machine's load moves a median). Prints one JSON line per bundle: ms per step at each position and the cache's MB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32768
POSITIONS = (100, 1000, 4000)

VISION = dict(depth=1, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=0,
              num_position_embeddings=2304, patch_size=16)
SHAPES = {
    "qwen3_5-0.8b": ("qwen3_5", dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                     linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                                     linear_conv_kernel_dim=4,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                      "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                                                      "partial_rotary_factor": 0.25})),
    "qwen3_5-2b": ("qwen3_5", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                   linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_conv_kernel_dim=4,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True,
                                                    "partial_rotary_factor": 0.25})),
    "qwen3_vl-2b": ("qwen3_vl", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                      "mrope_section": [24, 20, 20], "mrope_interleaved": True})),
}


def build(name: str, out: Path, depth: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import torchvision_ops

    torchvision_ops.declare()
    import torch
    from fixtures_qwen import make_tokenizer, write_processor_files
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    kind, text = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(out)
    ids.pop("vocab_size")
    eos = ids.pop("eos_token_id")
    text = {**text, "num_hidden_layers": depth, "vocab_size": VOCAB, "eos_token_id": eos, "bos_token_id": None}
    vision = {**VISION, "out_hidden_size": text["hidden_size"]}
    if kind == "qwen3_5":
        text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(depth)]
        cfg, cls = Qwen3_5Config(vision_config=vision, text_config=text, **ids), Qwen3_5ForConditionalGeneration
    else:
        vision["deepstack_visual_indexes"] = [0]
        cfg, cls = Qwen3VLConfig(vision_config=vision, text_config=text, **ids), Qwen3VLForConditionalGeneration
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(out)
    write_processor_files("qwen3_vl", out)
    return out


def time_positions(bundle: Path, steps: int, rounds: int = 4) -> dict:
    """ms per decode step from each of POSITIONS."""
    import numpy as np

    from vlmrt.runtime.vlm import VLM

    vlm = VLM.load(bundle)
    row = vlm.row
    cache = row.cache
    best = {p: float("inf") for p in POSITIONS}
    for _ in range(rounds):  # positions interleaved, the fastest step kept: a shared machine's load moves the median
        for p in POSITIONS:
            cache.reset()
            cache.length = p
            cache.positions[:, :p] = np.arange(p)
            for _ in range(steps):
                t = time.perf_counter()
                row.decode_token(5)
                best[p] = min(best[p], time.perf_counter() - t)
    out = {p: round(1000 * best[p], 2) for p in POSITIONS}
    return {"ms_per_step": out, "cache_mb": round(cache.nbytes / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--quant", default="w4a16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--only", default=None, help="one of " + ", ".join(SHAPES))
    a = ap.parse_args()
    from vlmrt.cli import main as cli

    work = Path(a.work or tempfile.mkdtemp(prefix="vlmrt-recurrent-"))
    for name in SHAPES:
        if a.only and a.only != name:
            continue
        ckpt, bundle = work / f"{name}-ckpt", work / f"{name}-{a.quant}-d{a.depth}"
        if not bundle.exists():
            build(name, ckpt, a.depth)
            rc = cli(["export", str(ckpt), str(bundle), "--quant", a.quant, "--max-seq-len", str(max(POSITIONS) + 512)])
            if rc:
                raise SystemExit(rc)
        print(json.dumps({"shape": name, "depth": a.depth, "quant": a.quant, **time_positions(bundle, a.steps)}),
              flush=True)


if __name__ == "__main__":
    main()
