"""Video input on the SmolVLM2-256M shape: frames/s of the vision encode, and what a follow-up question costs.

    python -m benchmarks.video_encode [--work /tmp/vlmrt-video-256m] [--seconds 20] [--json OUT]

Builds a random checkpoint with SmolVLM2-256M-Video-Instruct's vision tower (SigLIP 768 wide, 12 layers, 512 px tiles
of 16 px patches, 64 tokens per tile) and video settings (fps 1, at most 64 frames, frames resized to 512), with a
2-layer decoder of its width (the decoder's speed is not what this measures), exports it (fp32), then asks about an
animated GIF of --seconds seconds (one frame per 100 ms): the first question encodes every sampled frame through the
vision graph (one tile each); a follow-up question in the same conversation takes the frames' embeddings from the
image cache and the first turn's KV rows from the prefix cache. Prints the stats of both turns.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def checkpoint(out: Path) -> None:
    from fixtures import make_smolvlm_checkpoint

    text = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                vocab_size=49280, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=512,
                  patch_size=16)
    make_smolvlm_checkpoint(out, tile_size=512, patch_size=16, scale_factor=4, longest_edge_tiles=4, text_layers=2,
                            vision_layers=12, text_overrides={**text, "num_hidden_layers": 2}, vision_overrides=vision,
                            video_sampling={"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 512}})


def clip(path: Path, seconds: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (180, 320, 3)).astype(np.uint8)).quantize(64)
              for _ in range(seconds * 10)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/vlmrt-video-256m")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torchvision_ops  # noqa: F401  (transformers imports torchvision where it is installed)

    torchvision_ops.declare()
    from vlmrt.export.pipeline import export
    from vlmrt.runtime.vlm import VLM

    work = Path(a.work)
    ckpt, bundle, gif = work / "ckpt", work / "bundle", work / f"clip{a.seconds}.gif"
    if not (ckpt / "config.json").exists():
        checkpoint(ckpt)
    if not (bundle / "manifest.json").exists():
        t = time.perf_counter()
        export(str(ckpt), bundle, progress=False, max_seq_len=8192)
        print(f"exported in {time.perf_counter() - t:.0f} s", flush=True)
    if not gif.exists():
        clip(gif, a.seconds)
    vlm = VLM.load(bundle, threads=a.threads)
    msgs = [{"role": "user", "content": [{"type": "video", "video": str(gif)}, {"type": "text", "text": "What happens?"}]}]
    rows = []
    for turn in range(2):
        t = time.perf_counter()
        answer = "".join(vlm.chat(msgs, max_new_tokens=8, ignore_eos=True))
        s = vlm.result.stats
        rows.append({"turn": turn + 1, "wall_s": time.perf_counter() - t, "prompt_tokens": s.prompt_tokens,
                     "reused_prompt_tokens": s.reused_prompt_tokens, "frames": s.video_frames,
                     "frames_cached": s.images_cached, "preprocess_s": s.preprocess_s, "vision_s": s.vision_s,
                     "vision_frames_per_s": (s.video_frames - s.images_cached) / s.vision_s if s.vision_s and
                     s.video_frames > s.images_cached else None, "prefill_s": s.prefill_s, "ttft_s": s.ttft_s})
        print(json.dumps(rows[-1]), flush=True)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And after that?"}]
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
