"""What decoding a large JPEG smaller (Image.draft, runtime/media/image.py draft_request) changes: for the released processors'
image ops and photo-like JPEGs of several sizes, the decoded pixels, the decode time, and the processor's output
(every tile / patch row, in 0..255 levels) against a whole decode. docs/limits.md, "Decoded pixels", quotes it.

    python -m benchmarks.jpeg_draft [--sizes 6000x4000,8000x6000,12000x9000] [--json OUT]

The photo: tests/assets/rocket.jpg upscaled (bicubic) with per-pixel noise (sigma 8 levels) for sensor-like detail,
saved at JPEG quality 90 (4:2:0).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vlmrt.format.manifest import ImageSpec
from vlmrt.runtime.media.image import decode_image, preprocess, probe_image

ROOT = Path(__file__).resolve().parents[1]
MEAN = [0.5, 0.5, 0.5]
SPECS = {  # the released checkpoints' processors, as their bundles' manifests carry them
    "SmolVLM-256M (longest_edge 2048)": ImageSpec("longest_edge_grid", 512, 16, "lanczos", 1 / 255, MEAN, MEAN,
                                                  {"longest_edge": 2048, "split": True}),
    "InternVL3 (12 tiles of 448)": ImageSpec("closest_aspect_grid", 448, 14, "bicubic", 1 / 255, MEAN, MEAN,
                                             {"min_tiles": 1, "max_tiles": 12, "thumbnail": True}),
    "Qwen2.5-VL (4096 patches)": ImageSpec("smart_resize", 28, 14, "bicubic", 1 / 255, MEAN, MEAN,
                                           {"merge": 2, "temporal_patch": 2, "min_pixels": 3136,
                                            "max_pixels": 12845056, "max_patches": 4096}),
    "LFM2-VL (10 tiles of 512)": ImageSpec("naflex_tiles", 512, 16, "bilinear", 1 / 255, MEAN, MEAN,
                                           {"downsample_factor": 2, "min_image_tokens": 64, "max_image_tokens": 256,
                                            "max_pixels_tolerance": 2.0, "min_tiles": 2, "max_tiles": 10,
                                            "use_thumbnail": True, "max_num_patches": 1024, "split": True}),
}


def photo(w: int, h: int) -> bytes:
    rng = np.random.default_rng(0)
    im = Image.open(ROOT / "tests/assets/rocket.jpg").convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
    x = np.asarray(im, np.int16)
    for y in range(0, h, 512):  # in strips: the noise of a 108 MP image whole would be 650 MB of int16
        x[y:y + 512] += rng.normal(0, 8, x[y:y + 512].shape).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(x.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def levels(t, spec: ImageSpec) -> np.ndarray:
    """The processor's output back in 0..255 levels (its normalize undone)."""
    return t.pixels.astype(np.float64) * 0.5 / spec.rescale_factor + 127.5


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="6000x4000,8000x6000,12000x9000")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for size in a.sizes.split(","):
        w, h = map(int, size.split("x"))
        data = photo(w, h)
        t = time.perf_counter()
        whole = decode_image(data, "photo")
        whole_s = time.perf_counter() - t
        for name, spec in SPECS.items():
            head = probe_image(data, "photo", spec)
            t = time.perf_counter()
            drafted = decode_image(data, "photo", spec)
            draft_s = time.perf_counter() - t
            a_, b_ = preprocess(whole, spec), preprocess(drafted, spec)
            assert a_.grid == b_.grid and a_.pixels.shape == b_.pixels.shape, (name, a_.grid, b_.grid)
            d = np.abs(levels(a_, spec) - levels(b_, spec))
            row = dict(size=size, jpeg_bytes=len(data), processor=name, decoded=f"{drafted.width}x{drafted.height}",
                       scale=round(w / drafted.width, 2), decoded_mp=round(head.pixels / 1e6, 1),
                       whole_decode_s=round(whole_s, 2), draft_decode_s=round(draft_s, 2),
                       max_level_diff=round(float(d.max()), 2), mean_level_diff=round(float(d.mean()), 3),
                       share_over_4_levels=round(float((d > 4).mean()), 5))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del whole
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
