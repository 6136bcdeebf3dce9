"""The native-resolution image op (runtime/media/image_native.py) against transformers' Qwen2VLImageProcessorPil, the
processor of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: patches bit-exact, the same grid, at many sizes and aspect ratios,
and the patch budget's resize."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from conftest import IMAGES, image_file
from vlmrt.format.manifest import ImageSpec
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.media import image_native as native

pytest.importorskip("transformers")

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# (patch, mean, std): Qwen2.5-VL's processor (14 px, CLIP statistics) and Qwen3-VL's (16 px, 0.5)
PROCESSORS = {"qwen2_5_vl": (14, CLIP_MEAN, CLIP_STD), "qwen3_vl": (16, [0.5] * 3, [0.5] * 3)}


def spec(kind: str, min_pixels: int, max_pixels: int, max_patches: int = 10**9, resample="bicubic") -> ImageSpec:
    patch, mean, std = PROCESSORS[kind]
    return ImageSpec(tiling="smart_resize", tile_size=patch * 2, patch_size=patch, resample=resample,
                     rescale_factor=1 / 255, mean=mean, std=std,
                     params={"merge": 2, "temporal_patch": 2, "min_pixels": min_pixels, "max_pixels": max_pixels,
                             "max_patches": max_patches})


def processor(kind: str, min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch, mean, std = PROCESSORS[kind]
    return Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2, image_mean=mean,
                                    image_std=std, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def noise(h: int, w: int, seed: int = 0) -> Image.Image:
    """Random pixels: every resample tap shows in the result (a smooth picture would hide a wrong filter)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def check_equal(im: Image.Image, kind: str, min_pixels: int, max_pixels: int) -> native.NativePatches:
    want = processor(kind, min_pixels, max_pixels)(images=[im], return_tensors="np")
    got = native.smart_resize_patches(im, spec(kind, min_pixels, max_pixels))
    assert list(got.grid) == want["image_grid_thw"][0].tolist()
    assert got.patches.dtype == np.float32 and got.patches.shape == want["pixel_values"].shape
    np.testing.assert_array_equal(got.patches, want["pixel_values"])  # bit-exact: max |Δ| = 0
    assert not got.budget_limited
    return got


# (height, width): wide, tall, square, odd sizes, tiny (min_pixels decides), large (max_pixels decides), 1:150
SIZES = [(96, 160), (160, 96), (123, 77), (77, 123), (200, 200), (8, 9), (30, 31), (700, 1000), (1000, 700),
         (12, 1800), (57, 29)]


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_patches_equal_processor(kind, size):
    min_pixels, max_pixels = 56 * 56, 448 * 448
    got = check_equal(noise(*size), kind, min_pixels, max_pixels)
    factor = PROCESSORS[kind][0] * 2
    h, w = got.size
    assert h % factor == 0 and w % factor == 0
    if max(size) / min(size) < 50:  # at extreme aspect ratios the processor keeps one factor on the short side
        assert min_pixels <= h * w <= max_pixels


@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_at_min_and_max_pixels(kind):
    patch = PROCESSORS[kind][0]
    factor = 2 * patch
    small = check_equal(noise(20, 30, 1), kind, min_pixels=8 * factor * factor, max_pixels=64 * factor * factor)
    assert small.size[0] * small.size[1] >= 8 * factor * factor > round(20 / factor) * round(30 / factor) * factor**2
    big = check_equal(noise(900, 1300, 2), kind, min_pixels=4 * factor * factor, max_pixels=64 * factor * factor)
    assert big.size[0] * big.size[1] <= 64 * factor * factor < 900 * 1300


@pytest.mark.parametrize("image", IMAGES)
def test_sample_images_equal_processor(image, tmp_path):
    """The shipped and synthetic test images (photo, page, GIF, RGBA, tall), through load_image as the runtime reads
    them, at Qwen2.5-VL's processor settings with a small max_pixels."""
    im = img_ops.load_image(image_file(image, tmp_path))
    check_equal(im, "qwen2_5_vl", 56 * 56, 28 * 28 * 64)


def test_patch_flattening_order():
    """A row is one patch at (temporal, channel, py, px), patches in merge-block order: checked on an image whose
    pixel values name their own coordinates."""
    patch, merge = 2, 2
    h, w = 8, 4  # a 4x2 patch grid: 2x1 merge blocks
    x = np.arange(3 * h * w, dtype=np.float32).reshape(3, h, w)
    rows = native.patchify(x, patch, merge, temporal=2)
    assert rows.shape == (8, 3 * 2 * patch * patch)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]  # (patch row, patch col) per row
    for r, (py, px) in enumerate(order):
        block = x[:, py * patch:(py + 1) * patch, px * patch:(px + 1) * patch]  # [c, p, p]
        want = np.stack([block, block], axis=1).reshape(-1)  # [c, t, p, p]: the image repeated along t
        np.testing.assert_array_equal(rows[r], want)


@pytest.mark.parametrize("size", [(1000, 700), (700, 1000), (3000, 3000), (20, 2900), (2900, 20)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_patch_budget(size):
    """An image over the budget is resized as the processor with max_pixels = budget * patch² resizes it (bit-exact),
    says so, and always fits; under the budget nothing changes."""
    kind, budget = "qwen2_5_vl", 256
    patch = PROCESSORS[kind][0]
    im = noise(*size, seed=3)
    s = spec(kind, 56 * 56, 28 * 28 * 1280, max_patches=budget)
    got = native.smart_resize_patches(im, s)
    assert got.budget_limited
    assert len(got.patches) <= budget and len(got.patches) % 4 == 0
    if max(size) / min(size) < 50:
        want = processor(kind, 56 * 56, budget * patch * patch)(images=[im], return_tensors="np")
        assert list(got.grid) == want["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(got.patches, want["pixel_values"])
    else:  # the processor at that max_pixels keeps a 28 px short side and overflows the budget: the long side is cut
        assert min(got.grid[1:]) == 2 and len(got.patches) > budget - 4
    fits = native.smart_resize_patches(noise(150, 100), s)
    assert not fits.budget_limited and fits.size == native.smart_resize(150, 100, 28, 56 * 56, 28 * 28 * 1280)


def test_budget_override_and_bad_input():
    s = spec("qwen3_vl", 64 * 64, 1024 * 1024, max_patches=1024)
    assert native.with_max_patches(s, None) is s
    smaller = native.with_max_patches(s, 64)
    assert len(native.smart_resize_patches(noise(500, 500), smaller).patches) <= 64
    with pytest.raises(img_ops.ImageError, match="between 4 and this bundle's vision graph budget, 1024"):
        native.with_max_patches(s, 2048)
    with pytest.raises(img_ops.ImageError, match="between 4"):
        native.with_max_patches(s, 3)
    with pytest.raises(img_ops.ImageError, match="aspect ratio is 300:1"):
        native.smart_resize_patches(noise(3, 900), s)
    tiles = ImageSpec(tiling="closest_aspect_grid", tile_size=56, patch_size=14, resample="bicubic",
                      rescale_factor=1 / 255, mean=[0.5] * 3, std=[0.5] * 3, params={"max_tiles": 4, "min_tiles": 1})
    with pytest.raises(img_ops.ImageError, match="no patch budget"):
        native.with_max_patches(tiles, 64)


@pytest.mark.parametrize("layout", ["size", "min_max_pixels", "both"])
@pytest.mark.parametrize("kind", sorted(PROCESSORS))
def test_spec_from_processor_files(kind, layout, tmp_path):
    """preprocessor_config.json as transformers saves it (size), as the hub's Qwen2.5-VL files have it (min_pixels /
    max_pixels) or both: the image op set up from it (families/qwen_vl/processing.py) equals the processor loaded from
    the same file, and the budget is the processor's own max when that is below the default."""
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fixtures_qwen import TINY
    from vlmrt.families.qwen_vl.config import VisionConfig
    from vlmrt.families.qwen_vl.processing import DEFAULT_MAX_PATCHES, image_spec

    patch = PROCESSORS[kind][0]
    processor(kind, 6 * 28 * 28, 300 * 28 * 28).save_pretrained(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    pre = json.loads(path.read_text())
    if layout != "size":
        pre.update(min_pixels=8 * 28 * 28, max_pixels=200 * 28 * 28)  # these win over size
        if layout == "min_max_pixels":
            pre.pop("size")
        path.write_text(json.dumps(pre))
    proc = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    v = VisionConfig.from_hf(kind, TINY[kind][0])
    s = image_spec(pre, v)
    p = s.params
    lo, hi = (6, 300) if layout == "size" else (8, 200)
    assert (p["min_pixels"], p["max_pixels"]) == (lo * 784, hi * 784)
    assert p["max_patches"] == min(DEFAULT_MAX_PATCHES, p["max_pixels"] // patch**2 // 4 * 4)
    for size in [(300, 500), (40, 30), (900, 700)]:
        im = noise(*size, seed=9)
        want = proc(images=[im], return_tensors="np")
        got = native.smart_resize_patches(im, s)
        np.testing.assert_array_equal(got.patches, want["pixel_values"])
    assert image_spec(pre, v, max_patches=64).params["max_patches"] == 64
