"""LFM2-VL's host image op (runtime/media/image.py `naflex_tiles`, runtime/media/aa_resize.py) against transformers'
Lfm2VlImageProcessor (the torchvision one, tests/torchvision_ops.py): pixel values, patch masks, patch grids and the
tile grid equal the processor's, bit for bit, for small and tiled images of many sizes and aspect ratios."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from conftest import IMAGES, image_file
from vlmrt.format.manifest import ImageSpec
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.media.aa_resize import resize as aa_resize

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

# LFM2-VL-450M's preprocessor_config.json (transformers' Lfm2VlImageProcessor defaults but min/max image tokens)
REAL = dict(downsample_factor=2, min_tiles=2, max_tiles=10, use_thumbnail=True, min_image_tokens=64,
            max_image_tokens=256, encoder_patch_size=16, tile_size=512, max_pixels_tolerance=2.0, do_image_splitting=True)
# the same op at a tenth of the size: many shapes at little cost
SMALL = dict(downsample_factor=2, min_tiles=2, max_tiles=6, use_thumbnail=True, min_image_tokens=4,
             max_image_tokens=16, encoder_patch_size=8, tile_size=64, max_pixels_tolerance=2.0, do_image_splitting=True)


def processor(cfg: dict):
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    return Lfm2VlImageProcessor(**cfg, image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=2)


def spec(cfg: dict) -> ImageSpec:
    """The manifest's ImageSpec for cfg, as the lfm2_vl family writes it."""
    from fixtures_lfm2_vl import image_spec

    return image_spec(cfg)


def assert_equal_processor(im: Image.Image, cfg: dict, proc=None) -> img_ops.Tiles:
    proc = proc or processor(cfg)
    want = proc(images=[im], return_tensors="np", return_row_col_info=True)
    s = spec(cfg)
    if want["pixel_values"].shape[1] > s.params["max_num_patches"]:
        # an image so elongated (beyond ~1:40 here, ~1:250 at the real settings) that smart_resize keeps more patches
        # than the budget: the processor returns more patch rows than its mask has (a broken input the model cannot
        # take); vlmrt refuses it in one line
        with pytest.raises(img_ops.ImageError, match="patches; the bundle's vision graph takes"):
            img_ops.preprocess(im, s)
        return None
    got = img_ops.preprocess(im, s)
    n = len(want["pixel_values"])
    assert len(got.pixels) == n, (im.size, len(got.pixels), n)
    np.testing.assert_array_equal(got.pixels, want["pixel_values"])
    np.testing.assert_array_equal(got.patch_grids, want["spatial_shapes"])
    valid = np.arange(got.pixels.shape[1])[None] < got.patch_grids.prod(-1)[:, None]
    np.testing.assert_array_equal(valid.astype(np.int32), want["pixel_attention_mask"])
    rows, cols = want["image_rows"][0], want["image_cols"][0]
    assert (max(got.rows, 1), max(got.cols, 1)) == (rows, cols)
    assert (got.rows, got.cols) == ((0, 0) if rows * cols == 1 else (rows, cols))  # (0, 0): one tile, no grid
    # the single image or the thumbnail is the image_sizes the processor's prompt expansion counts tokens from
    if len(got.pixels) != rows * cols or rows * cols == 1:
        np.testing.assert_array_equal(got.patch_grids[-1] * cfg["encoder_patch_size"], want["image_sizes"][0])
    return got


def test_resize_equals_torchvision_antialiased_bilinear():
    """The resize arithmetic alone: torchvision's uint8 antialiased bilinear, down and up, odd sizes, one axis only,
    1-pixel images. Pillow's BILINEAR (the same filter, other rounding) differs on up to ~25% of pixels."""
    import torch
    from torchvision.transforms.v2 import functional as tvF

    rng = np.random.default_rng(0)
    cases = [(100, 77, 64, 96), (37, 300, 32, 256), (640, 480, 480, 640), (1, 1, 32, 32), (5, 7, 64, 3), (300, 200, 300, 64),
             (90, 400, 33, 400)] + [tuple(int(v) for v in rng.integers(1, 700, 4)) for _ in range(12)]
    for h, w, nh, nw in cases:
        x = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = tvF.resize(torch.from_numpy(x).permute(2, 0, 1).contiguous(), [nh, nw], antialias=True,
                          interpolation=tvF.InterpolationMode.BILINEAR).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(aa_resize(x, nh, nw, "bilinear"), want, err_msg=str((h, w, nh, nw)))


@pytest.mark.parametrize("image", IMAGES)
def test_real_config_images_equal_processor(image, tmp_path):
    """The repo's photos (all within the 256-token budget: one tile each) at LFM2-VL-450M's settings."""
    got = assert_equal_processor(img_ops.load_image(image_file(image, tmp_path)), REAL)
    assert len(got.pixels) == 1


@pytest.mark.parametrize("size", [(1100, 700), (700, 1500), (2300, 240), (1024, 1024)])
def test_real_config_tiled_equal_processor(size):
    """Images over the budget at the real settings: a grid of 512² tiles plus a thumbnail."""
    rng = np.random.default_rng(sum(size))
    w, h = size
    x = (np.linspace(0, 255, w)[None, :, None] + rng.integers(0, 80, (h, w, 3))).clip(0, 255).astype(np.uint8)
    got = assert_equal_processor(Image.fromarray(x), REAL)
    assert len(got.pixels) == got.rows * got.cols + 1 > 2


def test_small_config_many_shapes_equal_processor():
    """Aspect ratios from 1:40 to 40:1 and sizes from 1 pixel to several tiles at a small config: single images
    rounded up to the minimum and down to the maximum token count, grids of 2..6 tiles, exact aspect ties."""
    proc = processor(SMALL)
    rng = np.random.default_rng(1)
    sizes = [(1, 1), (3, 120), (120, 3), (16, 16), (40, 40), (64, 64), (65, 63), (128, 64), (64, 128), (200, 100), (96, 96),
             (300, 100), (100, 300), (400, 10), (10, 400), (129, 257)] + [tuple(int(v) for v in rng.integers(1, 420, 2))
                                                                            for _ in range(24)]
    tiled = refused = 0
    for w, h in sizes:
        got = assert_equal_processor(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), SMALL, proc)
        tiled += got is not None and got.rows > 0
        refused += got is None
    assert 5 < tiled < len(sizes) - 5 and refused <= 4  # both paths were exercised


def test_options_equal_processor():
    """No splitting (one resized image however large), no thumbnail."""
    rng = np.random.default_rng(2)
    im = Image.fromarray(rng.integers(0, 256, (150, 330, 3), dtype=np.uint8))
    got = assert_equal_processor(im, {**SMALL, "do_image_splitting": False})
    assert len(got.pixels) == 1
    got = assert_equal_processor(im, {**SMALL, "use_thumbnail": False})
    assert len(got.pixels) == got.rows * got.cols > 1
    got = assert_equal_processor(im, {**SMALL, "max_tiles": 2})
    assert len(got.pixels) == 3


def test_max_tiles_override_and_bad_filter():
    s = spec(SMALL)
    im = Image.new("RGB", (400, 100))
    assert len(img_ops.preprocess(im, s).pixels) == 4 + 1
    assert len(img_ops.preprocess(im, img_ops.with_max_tiles(s, 2)).pixels) == 2 + 1
    with pytest.raises(img_ops.ImageError, match=">= 2"):
        img_ops.with_max_tiles(s, 1)
    import dataclasses

    with pytest.raises(img_ops.ImageError, match="antialiased bilinear"):
        img_ops.preprocess(im, dataclasses.replace(s, resample="bicubic"))
