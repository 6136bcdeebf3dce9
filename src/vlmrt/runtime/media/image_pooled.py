"""Aspect-ratio patches for a pooling tower (Gemma 4's image processor, Gemma4ImageProcessorPil), Pillow + numpy only.

The image is resized (the bundle's filter: bicubic), keeping its aspect ratio, to the largest sides that are multiples
of pooling_kernel × patch and give at most max_soft_tokens × kernel² patches (`pooled_size`: transformers'
get_aspect_ratio_preserving_size, a thin image's short side kept at one kernel), rescaled (and normalized: Gemma 4
does neither beyond 1/255), cut into patch rows in raster order, each row (py, px, c), and padded with zero rows to
the vision graph's budget (max_soft_tokens × kernel²). Each real row's position is its patch (x, y); padding rows
are (-1, -1). The tower pools each kernel² block of the patch grid into one image token: an image of gh × gw
patches gives (gh / k)·(gw / k) tokens, the first rows of the graph's output.

The manifest selects it with `image.tiling` = "pooled_aspect" (params: max_soft_tokens, pooling_kernel) and
`vision.tile_inputs` = "pooled_positions" (runtime/media/tile_inputs.py: the patch rows and the positions).
Gemma 4's video frames (Gemma4VideoProcessor) are "pooled_aspect_tensor": the same patches at the video processor's
budget (its max_soft_tokens), resized by torchvision's uint8 resize, padded to the graph's budget (graph_patches).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ...format.manifest import ImageSpec
from .pixels import ImageError, normalize, resample_filter

if TYPE_CHECKING:
    from PIL import Image


def pooled_size(height: int, width: int, patch: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """transformers' gemma4 get_aspect_ratio_preserving_size: the resized (height, width)."""
    target_px = max_patches * patch ** 2
    factor = math.sqrt(target_px / (height * width))
    side = kernel * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ImageError(f"a {width}×{height} image cannot be resized to a multiple of {side} pixels")
    longest = (max_patches // kernel ** 2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    if h * w > target_px:
        raise ImageError(f"a {width}×{height} image resizes to {w}×{h}, over {max_patches} patches")
    return h, w


def pooled_patches(im: Image.Image, spec: ImageSpec, tensor_resize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One image -> (patch rows [budget, p·p·3] float32, zero rows after the real ones; its patch grid [gh, gw]).
    The size is the one of max_soft_tokens × kernel² patches; the rows are padded to params["graph_patches"] where
    given (a video frame's budget below the vision graph's), else to that budget. tensor_resize: resized by
    torchvision's antialiased uint8 resize (runtime/media/aa_resize.py, what Gemma4VideoProcessor resizes frames
    with), else by Pillow (Gemma4ImageProcessorPil)."""
    p, patch = spec.params, spec.patch_size
    kernel, budget = int(p["pooling_kernel"]), int(p["max_soft_tokens"]) * int(p["pooling_kernel"]) ** 2
    width, height = im.size
    h, w = pooled_size(height, width, patch, budget, kernel)
    if (h, w) != (im.height, im.width):
        if tensor_resize:
            from PIL import Image as PILImage

            from . import aa_resize

            im = PILImage.fromarray(aa_resize.resize(np.asarray(im.convert("RGB"), np.uint8), h, w, spec.resample))
        else:
            im = im.resize((w, h), resample=resample_filter(spec.resample))
    x = normalize([im], spec)[0].transpose(1, 2, 0)  # [h, w, 3]
    gh, gw = h // patch, w // patch
    rows = x.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, patch * patch * 3)
    out = np.zeros((int(p.get("graph_patches", budget)), patch * patch * 3), np.float32)
    out[: len(rows)] = rows
    return out, np.array([gh, gw], np.int64)


def positions(grid, budget: int) -> np.ndarray:
    """[budget, 2] int64: (x, y) of each real patch row in raster order, (-1, -1) after them."""
    gh, gw = int(grid[0]), int(grid[1])
    out = np.full((budget, 2), -1, np.int64)
    ys, xs = np.divmod(np.arange(gh * gw), gw)
    out[: gh * gw, 0], out[: gh * gw, 1] = xs, ys
    return out


def tokens(grid, kernel: int) -> int:
    return (int(grid[0]) // kernel) * (int(grid[1]) // kernel)
