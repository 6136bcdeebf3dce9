"""Pixel primitives the tiling ops share (runtime/media/image.py, runtime/media/image_native.py): the image error, the manifest's
resample filter names, rescale + normalize."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...format.manifest import ImageSpec

if TYPE_CHECKING:
    from PIL import Image
# Pillow is imported where an image is read, not with this module: a text-only run does not load it (cold start)
RESAMPLE = {"nearest": "NEAREST", "bilinear": "BILINEAR", "bicubic": "BICUBIC", "lanczos": "LANCZOS", "box": "BOX",
            "hamming": "HAMMING"}  # the manifest's names -> PIL's


class ImageError(ValueError):
    pass


def resample_filter(name: str):
    from PIL import Image

    if name not in RESAMPLE:
        raise ImageError(f"this vlmrt has no resample filter {name!r}; upgrade vlmrt")
    return Image.Resampling[RESAMPLE[name]]


def normalize(tiles: list[Image.Image], spec: ImageSpec) -> np.ndarray:
    """uint8 tiles -> [tiles, 3, H, W] float32: x * rescale (in float64, as transformers) then (x - mean) / std."""
    x = np.stack([np.asarray(t, dtype=np.uint8) for t in tiles])  # [tiles, H, W, 3]
    x = (x.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
