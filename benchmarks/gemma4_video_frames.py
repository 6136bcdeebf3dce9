"""Gemma 4 video frames on the host: what turning sampled frames into vision-graph rows costs at the released
settings (Gemma4VideoProcessor's class defaults: 32 frames, 70 soft tokens a frame, 16-px patches pooled 3×3; the
image processor's 280 tokens sets the graph's 2,520 rows a frame is padded to).

    python -m benchmarks.gemma4_video_frames [--frames 32] [--size 1280x720] [--reps 2]

Random frames of --size through runtime/media/video.py's frame op (pooled_aspect_tensor: the aspect-ratio size, then
torchvision's antialiased uint8 bicubic in numpy, x / 255, patch rows); prints the time per clip and per frame. The
vision encode is not measured here.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    from PIL import Image

    from vlmrt.format.manifest import ImageSpec, VideoSpec
    from vlmrt.runtime.media import video as V

    w, h = map(int, a.size.split("x"))
    frame = ImageSpec("pooled_aspect_tensor", 48, 16, "bicubic", 1 / 255, [0.0] * 3, [1.0] * 3,
                      {"max_soft_tokens": 70, "pooling_kernel": 3, "graph_patches": 2520})
    spec = VideoSpec(0.0, a.frames, "<|video|>", "{timestamp} ", separator=" ", sampling="uniform",
                     frames="image_tiling", frame_image=frame)
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(a.frames)]
    for _ in range(a.reps):
        t = time.perf_counter()
        out = [V.frame_tiles(f, spec, frame) for f in frames]
        dt = time.perf_counter() - t
        gh, gw = out[0].patch_grids[0].tolist()
        print(f"{a.frames} frames {w}x{h} -> {gh}x{gw} patches ({gh // 3 * (gw // 3)} tokens) each: {dt:.2f} s "
              f"({dt / a.frames * 1000:.0f} ms a frame)")


if __name__ == "__main__":
    main()
