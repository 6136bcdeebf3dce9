"""Host tiling ops against transformers' image processors (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from conftest import IMAGES, image_file
from vlmrt.format.manifest import ImageSpec
from vlmrt.runtime.media import image as img_ops

pytest.importorskip("transformers")


def internvl_spec(tile: int, max_tiles: int, min_tiles: int = 1) -> ImageSpec:
    return ImageSpec(tiling="closest_aspect_grid", tile_size=tile, patch_size=14, resample="bicubic", rescale_factor=1 / 255,
                     mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225],
                     params={"min_tiles": min_tiles, "max_tiles": max_tiles, "thumbnail": True})


def test_best_grid_matches_transformers_exhaustively():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    for max_tiles in (1, 2, 6, 12):
        for min_tiles in (1, 2):
            if min_tiles > max_tiles:
                continue
            for h in range(1, 1400, 37):
                for w in range(1, 1400, 41):
                    want = get_optimal_tiled_canvas((h, w), (448, 448), min_tiles, max_tiles)
                    assert img_ops.best_grid(h, w, 448, min_tiles, max_tiles) == want, (h, w, min_tiles, max_tiles)


@pytest.mark.parametrize("max_tiles", [1, 4, 12])
@pytest.mark.parametrize("image", IMAGES)
def test_closest_aspect_grid_pixels_equal_gotocr2(image, max_tiles, tmp_path):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tile = 56
    proc = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1,
                                    max_patches=max_tiles, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    path = image_file(image, tmp_path)
    out = proc(images=[Image.open(path)], return_tensors="np")
    got = img_ops.preprocess(img_ops.load_image(path), internvl_spec(tile, max_tiles))
    assert out["num_patches"][0] == len(got.pixels)
    np.testing.assert_array_equal(got.pixels, out["pixel_values"])


def test_max_tiles_override():
    spec = internvl_spec(56, 12)
    im = Image.new("RGB", (400, 100))
    assert len(img_ops.preprocess(im, spec).pixels) == 4 + 1
    assert len(img_ops.preprocess(im, img_ops.with_max_tiles(spec, 2)).pixels) == 2 + 1
    assert len(img_ops.preprocess(im, img_ops.with_max_tiles(spec, 1)).pixels) == 1
    smol = ImageSpec(tiling="longest_edge_grid", tile_size=64, patch_size=8, resample="lanczos", rescale_factor=1 / 255,
                     mean=[0.5] * 3, std=[0.5] * 3, params={"longest_edge": 128, "split": True})
    with pytest.raises(img_ops.ImageError, match="no tile-count setting"):
        img_ops.with_max_tiles(smol, 2)
    with pytest.raises(img_ops.ImageError, match=">= 1"):
        img_ops.with_max_tiles(spec, 0)


def test_unfold_patches_is_conv2d_as_matmul():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    tile = rng.standard_normal((3, 28, 28)).astype(np.float32)
    w = rng.standard_normal((5, 3, 7, 7)).astype(np.float32)
    conv = torch.nn.functional.conv2d(torch.from_numpy(tile)[None], torch.from_numpy(w), stride=7)[0]  # [5, 4, 4]
    want = conv.flatten(1).T.numpy()  # [patches, out] in raster order
    got = img_ops.unfold_patches(tile, 7) @ w.reshape(5, -1).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def exported_spec(ckpt, tmp, **edit) -> ImageSpec:
    """The ImageSpec the exporter writes for ckpt with its preprocessor_config.json edited (the family's host_spec on a
    copy of the checkpoint's processor files)."""
    import json
    import shutil

    from vlmrt.families.checkpoint import Checkpoint
    from vlmrt.families import family_for

    folder = tmp / "ckpt"
    shutil.copytree(ckpt, folder, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**pre, **edit}))
    ck = Checkpoint.open(folder)
    fam = family_for(ck.config)
    return fam.host(ck, fam.config(ck.config), json.loads((folder / "tokenizer.json").read_text())).image


@pytest.mark.parametrize("resample", [4, 5])  # PIL's BOX and HAMMING
@pytest.mark.parametrize("family", ["smolvlm", "internvl"])
def test_every_pil_resample_filter_equals_transformers(family, resample, default_bundle, tmp_path_factory, tmp_path):
    """preprocessor_config.json may name any of Pillow's six filters (transformers takes them all): BOX and HAMMING used
    to fail the export with `KeyError: 4`."""
    import oracle
    import test_internvl as ivl
    from fixtures import SMOLVLM
    from fixtures_internvl import INTERNVL

    ex = default_bundle if family == "smolvlm" else ivl.exported(ivl.CASES[0], tmp_path_factory)
    fam = SMOLVLM if family == "smolvlm" else INTERNVL
    spec = exported_spec(ex.ckpt, tmp_path, resample=resample)
    assert spec.resample == {4: "box", 5: "hamming"}[resample]
    proc = oracle.processor(fam, tmp_path / "ckpt")
    for name in ("chelsea.png", "tall"):
        im = Image.open(image_file(name, tmp_path))
        want = proc.image_processor(images=[[im]] if fam.nested_images else [im], return_tensors="np",
                                    **({} if fam.nested_images else {"crop_to_patches": True}))["pixel_values"]
        got = img_ops.preprocess(img_ops.load_image(image_file(name, tmp_path)), spec).pixels
        np.testing.assert_array_equal(got, want[0] if fam.pixel_batch_dim else want)


@pytest.mark.parametrize("family", ["smolvlm", "internvl"])
def test_one_number_image_mean_and_std_equal_transformers(family, default_bundle, tmp_path_factory, tmp_path):
    """image_mean / image_std may be one number for every channel (transformers broadcasts it); the export wrote it
    as it was and failed its own manifest check ("image.mean must be a list, not 0.5")."""
    import dataclasses

    import oracle
    import test_internvl as ivl
    from fixtures import SMOLVLM
    from fixtures_internvl import INTERNVL
    from vlmrt.format import manifest as mf

    ex = default_bundle if family == "smolvlm" else ivl.exported(ivl.CASES[0], tmp_path_factory)
    fam = SMOLVLM if family == "smolvlm" else INTERNVL
    spec = exported_spec(ex.ckpt, tmp_path, image_mean=0.4, image_std=0.3)
    assert mf.build(ImageSpec, dataclasses.asdict(spec), "image") == spec  # what the manifest loader checks
    assert spec.mean == [0.4] * 3 and spec.std == [0.3] * 3
    im = Image.open(image_file("chelsea.png", None))
    proc = oracle.processor(fam, tmp_path / "ckpt")
    want = proc.image_processor(images=[[im]] if fam.nested_images else [im], return_tensors="np",
                                **({} if fam.nested_images else {"crop_to_patches": True}))["pixel_values"]
    got = img_ops.preprocess(img_ops.load_image(image_file("chelsea.png", None)), spec).pixels
    np.testing.assert_array_equal(got, want[0] if fam.pixel_batch_dim else want)
