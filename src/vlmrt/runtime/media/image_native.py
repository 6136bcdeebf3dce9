"""Native-resolution image ops (Qwen2-VL / Qwen2.5-VL / Qwen3-VL's image processor), Pillow + numpy only.

The image is resized, keeping its aspect ratio, to sides that are multiples of patch × merge with an area between
`min_pixels` and `max_pixels` (`smart_resize`), rescaled and normalized as `runtime/media/image.py` does for tiles, then cut
into patches of `patch`² pixels with a temporal patch of `temporal_patch` (a still image is repeated), flattened in
the processor's order: merge blocks row-major, the merge × merge patches of a block row-major, each row
(channel, temporal, py, px) — the layout of the Conv3d patch embedding's weight flattened to [out, c*t*p*p].

The vision graph is static: it takes `max_patches` rows (the **patch budget**, `image.params.max_patches`) and a
key mask (runtime/media/vision_inputs.py). An image the processor would make larger than the budget is resized as the
processor would with `max_pixels = max_patches * patch²` (and, for an aspect ratio so extreme that even that does
not fit, with its long side cut to fit); `NativePatches.budget_limited` says so (a run's `stats.images_resized`, in `--json`).

The manifest selects this op with `image.tiling` = "smart_resize"; its `image.params`: merge, temporal_patch,
min_pixels, max_pixels (the processor's), max_patches (the graph's budget). `image.tile_size` is patch × merge,
the multiple both sides are resized to.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...format.manifest import ImageSpec
from .pixels import ImageError, normalize, resample_filter

if TYPE_CHECKING:
    from PIL import Image

MAX_ASPECT = 200  # the processor refuses images whose long side is over 200 times the short one


@dataclass
class NativePatches:
    patches: np.ndarray  # [grid_h * grid_w, c * temporal * patch * patch] float32, in merge-block order
    grid: tuple[int, int, int]  # (t, h, w) in patches: the processor's image_grid_thw row
    size: tuple[int, int]  # (height, width) of the resized image in pixels
    budget_limited: bool  # smaller than the processor's own max_pixels would make it: the patch budget decided
    merge_unit: int  # patches per merge block (merge²)

    @property
    def tokens(self) -> int:
        """Image tokens in the prompt: one per merge block (what the patch merger outputs)."""
        return len(self.patches) // self.merge_unit


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `qwen2_vl.image_processing_qwen2_vl.smart_resize`: (height, width) as multiples of factor whose
    area is within [min_pixels, max_pixels] where the aspect ratio allows, the aspect ratio kept as closely as it can."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"the image's aspect ratio is {max(height, width) / min(height, width):.0f}:1; this model's "
                         f"image processor takes up to {MAX_ASPECT}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def budget_size(height: int, width: int, patch: int, merge: int, min_pixels: int, max_pixels: int,
                max_patches: int) -> tuple[int, int, bool]:
    """The resized (height, width) under a patch budget, and whether the budget made it smaller than the processor's
    max_pixels would. Within the budget this is smart_resize with max_pixels = min(max_pixels, max_patches * patch²);
    smart_resize keeps a side at one factor however thin the image, so at an extreme aspect ratio its result can
    still be over that area: then the long side is cut to the most factors that fit (the short one is at one)."""
    factor = patch * merge
    if max_patches < merge * merge:
        raise ImageError(f"a patch budget of {max_patches} patches is below one merge block ({merge * merge})")
    own = smart_resize(height, width, factor, min_pixels, max_pixels)
    h, w = smart_resize(height, width, factor, min_pixels, min(max_pixels, max_patches * patch * patch))
    if (h // patch) * (w // patch) > max_patches:
        blocks = max_patches // (merge * merge)  # merge blocks the budget holds
        short = min(min(h, w) // factor, blocks)
        long = blocks // short
        h, w = (short * factor, long * factor) if h <= w else (long * factor, short * factor)
    return h, w, (h, w) != own


def patchify(x: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[c, H, W] -> [(H/p)*(W/p), c*temporal*p*p]: the processor's `patchify` (merge-block order, the image repeated
    `temporal` times along the temporal axis of each row)."""
    c, height, width = x.shape
    gh, gw = height // patch, width // patch
    x = x.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, c, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, *x.shape[5:]))
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal * patch * patch), dtype=np.float32)


def smart_resize_patches(im: Image.Image, spec: ImageSpec) -> NativePatches:
    """One image -> its flattened patches at native resolution under the bundle's patch budget."""
    p = spec.params
    patch, merge, temporal = spec.patch_size, int(p["merge"]), int(p["temporal_patch"])
    width, height = im.info.get("vlmrt.source_size", im.size)  # image.source_size: a JPEG decoded smaller
    h, w, limited = budget_size(int(height), int(width), patch, merge, int(p["min_pixels"]), int(p["max_pixels"]),
                                int(p["max_patches"]))
    if (h, w) != (im.height, im.width):
        im = im.resize((w, h), resample=resample_filter(spec.resample))
    x = normalize([im], spec)[0]  # [3, h, w] float32
    return NativePatches(patchify(x, patch, merge, temporal), (1, h // patch, w // patch), (h, w), limited,
                         merge * merge)


def with_max_patches(spec: ImageSpec, max_patches: int | None) -> ImageSpec:
    """The spec with a user's smaller patch budget (`--max-patches`): never above the graph's, at least one block."""
    if max_patches is None:
        return spec
    if "max_patches" not in spec.params:
        raise ImageError(f"this bundle's image op ({spec.tiling}) has no patch budget; --max-patches does not apply")
    graph = int(spec.params["max_patches"])
    unit = int(spec.params["merge"]) ** 2
    if not unit <= max_patches <= graph:
        raise ImageError(f"--max-patches must be between {unit} and this bundle's vision graph budget, {graph}")
    return dataclasses.replace(spec, params={**spec.params, "max_patches": max_patches})


def pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
    """[n, d] -> [rows, d], zero rows after the n real ones (the static graph's padding; masked as keys)."""
    if len(x) > rows:
        raise AssertionError(f"{len(x)} rows do not fit a graph of {rows}")
    out = np.zeros((rows, *x.shape[1:]), x.dtype)
    out[: len(x)] = x
    return out


NATIVE = {"smart_resize": smart_resize_patches}
