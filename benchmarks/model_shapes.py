"""Export + run timing for random checkpoints with real model shapes, on this machine.

    python -m benchmarks.model_shapes smolvlm-256m|smolvlm-500m|internvl3-1b|internvl3_5-1b|lfm2-vl-450m [--work DIR] [--image P]
        [--depth TEXT,VISION] [--export-args "--target htp --quant ..."] [--no-run]

Builds the checkpoint with transformers (a test dependency; tests/fixtures*.py), then times
`vlmrt export` and `vlmrt run` (hybrid and kv) as a user runs them, each in a fresh process, and prints the
bundle's file table. --depth keeps the real widths at fewer layers (sizes and times per layer, to extrapolate
what a full-depth export does not fit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def smolvlm_256m(out: Path, depth: tuple[int, int] = (30, 12)) -> None:
    # HuggingFaceTB/SmolVLM-256M-Instruct config.json sizes
    from fixtures import make_smolvlm_checkpoint

    text = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                head_dim=64, vocab_size=49280, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512, patch_size=16)
    make_smolvlm_checkpoint(out, tie_word_embeddings=False, tile_size=512, patch_size=16, scale_factor=4, longest_edge_tiles=4,
                            text_layers=depth[0], vision_layers=depth[1], text_overrides={**text, "num_hidden_layers": depth[0]},
                            vision_overrides={**vision, "num_hidden_layers": depth[1]})


def smolvlm_500m(out: Path, depth: tuple[int, int] = (32, 12)) -> None:
    # HuggingFaceTB/SmolVLM-500M-Instruct config.json sizes (SmolLM2-360M + the same SigLIP-base tower as 256M)
    from fixtures import make_smolvlm_checkpoint

    text = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=depth[0], num_attention_heads=15,
                num_key_value_heads=5, head_dim=64, vocab_size=49280, rope_theta=100000.0, max_position_embeddings=8192,
                rms_norm_eps=1e-5)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=depth[1], num_attention_heads=12, image_size=512, patch_size=16)
    make_smolvlm_checkpoint(out, tie_word_embeddings=True, tile_size=512, patch_size=16, scale_factor=4, longest_edge_tiles=4,
                            text_layers=depth[0], vision_layers=depth[1], text_overrides=text, vision_overrides=vision)


def internvl3_1b(out: Path, depth: tuple[int, int] = (24, 24)) -> None:
    # OpenGVLab/InternVL3-1B-hf: InternViT-300M-448px + Qwen2.5-0.5B
    from fixtures_internvl import make_internvl_checkpoint

    text = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=depth[0], num_attention_heads=14, num_key_value_heads=2,
                head_dim=64, vocab_size=151674, rope_theta=1000000.0, max_position_embeddings=32768)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=depth[1], num_attention_heads=16)
    make_internvl_checkpoint(out, decoder="qwen2", tie_word_embeddings=True, image_size=448, patch_size=14, max_tiles=12,
                             text_layers=depth[0], vision_layers=depth[1], text_overrides=text, vision_overrides=vision)


def internvl3_5_1b(out: Path, depth: tuple[int, int] = (28, 24)) -> None:
    # OpenGVLab/InternVL3_5-1B-HF: InternViT-300M-448px-V2.5 + Qwen3-0.6B (q/k norms, head_dim 128, tied embeddings)
    # (max_tiles 1: the graphs are per tile; one tile keeps a calibration prompt inside a small HTP context)
    from fixtures_internvl import make_internvl_checkpoint

    text = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=depth[0], num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960)
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=depth[1], num_attention_heads=16)
    make_internvl_checkpoint(out, decoder="qwen3", tie_word_embeddings=True, image_size=448, patch_size=14, max_tiles=1,
                             text_layers=depth[0], vision_layers=depth[1], text_overrides=text, vision_overrides=vision)


# LiquidAI/LFM2-VL-450M: LFM2-350M (16 layers: attention at 2, 5, 8, 10, 12, 14, gated short convs elsewhere) +
# SigLIP2 NaFlex base-patch16 (86M) + a 2560-wide projector; 512² tiles of 16 px patches, 64..256 tokens an image
LFM2_350M_LAYERS = tuple("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16))


def lfm2_vl_450m(out: Path, depth: tuple[int, int] = (16, 12)) -> None:
    from fixtures_lfm2_vl import make_lfm2_vl_checkpoint

    layers = LFM2_350M_LAYERS[: depth[0]]
    text = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, vocab_size=65536, norm_eps=1e-5,
                block_multiple_of=256, max_position_embeddings=128000)
    vision = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=depth[1])
    make_lfm2_vl_checkpoint(out, layer_types=layers, tile_size=512, patch_size=16, min_image_tokens=64,
                            max_image_tokens=256, max_tiles=10, vision_layers=depth[1], position_side=16,
                            intermediate=6656, auto_adjust_ff=True, projector_hidden=2560, text_overrides=text,
                            vision_overrides=vision)


MODELS = {"smolvlm-256m": smolvlm_256m, "smolvlm-500m": smolvlm_500m, "internvl3-1b": internvl3_1b, "internvl3_5-1b": internvl3_5_1b,
          "lfm2-vl-450m": lfm2_vl_450m}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--work", default=None)
    ap.add_argument("--image", default=str(ROOT / "tests/assets/chelsea.png"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--depth", default=None, help="TEXT,VISION layers (default: the model's)")
    ap.add_argument("--export-args", default="", help="more `vlmrt export` arguments, e.g. \"--target htp --quant ...\"")
    ap.add_argument("--no-run", action="store_true", help="export only")
    a = ap.parse_args()
    import torchvision_ops

    torchvision_ops.declare()  # transformers imports torchvision where it is installed (tests/torchvision_ops.py)
    work = Path(a.work or f"/tmp/vlmrt-shape-{a.model}")
    ckpt, bundle = work / "ckpt", work / "bundle"
    if not (ckpt / "config.json").exists():
        MODELS[a.model](ckpt, *([tuple(int(x) for x in a.depth.split(","))] if a.depth else []))
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vlmrt.cli", "export", str(ckpt), str(bundle), "--force", *a.export_args.split()],
                   check=True)
    export_s = time.perf_counter() - t
    size = sum(p.stat().st_size for p in bundle.iterdir()) / 1e6
    print(f"{a.model} export: {export_s:.1f} s, bundle {size:.0f} MB")
    for p in sorted(bundle.iterdir()):
        print(f"| `{p.name}` | {p.stat().st_size:,} |")
    if a.no_run:
        return
    for mode in ("hybrid", "kv"):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "run", str(bundle), "--image", a.image, "--prompt",
                            "Describe this image.", "--max-new-tokens", str(a.tokens), "--ignore-eos", "--mode", mode, "--json"],
                           check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t
        s = json.loads(p.stdout.strip().splitlines()[-1])["stats"]
        print(f"run --mode {mode}: wall {wall:.1f} s | prompt {s['prompt_tokens']} tokens, {s['image_tiles']} tiles | "
              f"load {s['load_s']:.2f} s, preprocess {s['preprocess_s']:.3f} s, vision {s['vision_s']:.2f} s, "
              f"TTFT {s['ttft_s']:.2f} s, prefill {s['prefill_tokens_per_s']:.0f} tok/s, "
              f"decode {s['decode_tokens_per_s']:.1f} tok/s, peak RSS {s['peak_rss_mb']:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
