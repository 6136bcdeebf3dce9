"""The browser runtime's image preprocessing is the Python runtime's to the bit: static/resample.js against Pillow's
Image.resize for every filter, and static/image.js's tiling + normalize against runtime/media/image.py preprocess on a
SmolVLM-shaped, an InternVL-shaped and a Gemma 4-shaped bundle's image spec (and the real models' sizes), in headless
Chromium."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io

import numpy as np
import pytest
from PIL import Image

from conftest import ASSETS, synthetic
from web_browser import STATIC, browser, served

from vlmrt.format.manifest import ImageSpec
from vlmrt.runtime.media.image import RESAMPLE, load_image, preprocess, to_rgb

B64 = "b => Uint8Array.from(atob(b), c => c.charCodeAt(0))"
TO_B64 = "u => { let s = ''; for (let i = 0; i < u.length; i += 32768) s += String.fromCharCode(...u.subarray(i, i + 32768)); return btoa(s); }"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with served(STATIC) as url, browser(tmp_path_factory.mktemp("profile")) as ctx:
        p = ctx.new_page()
        p.goto(url + "/npy.js")  # any document of the origin: the tests import the modules themselves
        yield p


def _rgb(w: int, h: int, seed: int) -> np.ndarray:
    """Structured noise: smooth ramps plus sharp noise, so that every filter tap matters."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, w)[None, :, None] + np.linspace(0, 55, h)[:, None, None]
    return (ramp + rng.integers(-60, 60, (h, w, 3))).clip(0, 255).astype(np.uint8)


# (in w, in h, out w, out h): down and up, by large and tiny factors, 1-pixel sides, odd sizes
SIZES = [(64, 48, 17, 13), (17, 13, 64, 48), (300, 451, 512, 768), (451, 300, 1100, 733), (130, 340, 64, 64),
         (1, 37, 5, 3), (37, 1, 4, 9), (97, 61, 97, 30), (97, 61, 40, 61), (1024, 8, 33, 3), (5, 5, 448, 448)]


@pytest.mark.parametrize("name", sorted(RESAMPLE))
def test_resize_is_pillows(page, name):
    cases = []
    for i, (w, h, ow, oh) in enumerate(SIZES):
        x = _rgb(w, h, i)
        want = np.asarray(Image.fromarray(x).resize((ow, oh), resample=Image.Resampling[RESAMPLE[name]]))
        cases.append((x, ow, oh, want))
    got = page.evaluate(f"""async ([cases, name]) => {{
        const {{ resize }} = await import('/resample.js');
        const b64 = {B64}, tob64 = {TO_B64};
        return cases.map(([d, w, h, ow, oh]) => tob64(resize({{ width: w, height: h, data: b64(d) }}, ow, oh, name).data));
    }}""", [[[base64.b64encode(x.tobytes()).decode(), x.shape[1], x.shape[0], ow, oh] for x, ow, oh, _ in cases], name])
    for (x, ow, oh, want), g in zip(cases, got):
        js = np.frombuffer(base64.b64decode(g), np.uint8).reshape(oh, ow, 3)
        diff = np.abs(js.astype(int) - want.astype(int))
        assert diff.max() == 0, f"{name} {x.shape[1]}x{x.shape[0]} -> {ow}x{oh}: {np.count_nonzero(diff)} values differ (max {diff.max()})"


def _png_uri(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _browser_preprocess(page, uri: str, spec: ImageSpec, full: bool = False):
    """(sha256 of the float32 pixels, grid), or with full the pixels themselves (a 17-tile image is 53 MB)."""
    r = page.evaluate(f"""async ([uri, spec, full]) => {{
        const m = await import('/image.js');
        const x = m.preprocess(await m.decodeImage(uri), spec);
        const bytes = new Uint8Array(x.pixels.buffer);
        const digest = Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', bytes)), b => b.toString(16).padStart(2, '0')).join('');
        const tob64 = {TO_B64};
        return [full ? tob64(bytes) : digest, x.grid];
    }}""", [uri, dataclasses.asdict(spec), full])
    return (np.frombuffer(base64.b64decode(r[0]), np.float32) if full else r[0]), tuple(r[1])


def _images(tmp_path) -> dict[str, Image.Image]:
    ims = {name: load_image(ASSETS / name) for name in ("chelsea.png", "page.png", "camera.png")}
    ims["tall"] = synthetic("tall")
    for w, h in ((1, 1), (3, 200), (700, 2), (65, 64), (129, 257)):
        ims[f"{w}x{h}"] = Image.fromarray(_rgb(w, h, w * h))
    return ims


SMOLVLM = dict(tiling="longest_edge_grid", resample="lanczos", rescale_factor=1 / 255, mean=[0.5] * 3, std=[0.5] * 3)
INTERNVL = dict(tiling="closest_aspect_grid", resample="bicubic", rescale_factor=1 / 255,
                mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
SPECS = {
    # the tiny test bundles' shapes (conftest.CASES[0], test_internvl.CASES[0]) and the real models'
    "smolvlm-tiny": ImageSpec(tile_size=64, patch_size=8, params={"longest_edge": 192, "split": True}, **SMOLVLM),
    "smolvlm-nosplit": ImageSpec(tile_size=32, patch_size=4, params={"longest_edge": 64, "split": False}, **SMOLVLM),
    "smolvlm-256m": ImageSpec(tile_size=512, patch_size=16, params={"longest_edge": 2048, "split": True}, **SMOLVLM),
    "internvl-tiny": ImageSpec(tile_size=28, patch_size=7, params={"min_tiles": 1, "max_tiles": 6, "thumbnail": True},
                               **INTERNVL),
    "internvl3-1b": ImageSpec(tile_size=448, patch_size=14, params={"min_tiles": 1, "max_tiles": 12, "thumbnail": True},
                              **INTERNVL),
    # Gemma 4's pooled_aspect (static/image_pooled.js): the tiny test bundle's (tests/fixtures_gemma4.py) and E2B's
    "gemma4-tiny": ImageSpec(tiling="pooled_aspect", tile_size=12, patch_size=4, resample="bicubic",
                             rescale_factor=1 / 255, mean=[0.0] * 3, std=[1.0] * 3,
                             params={"max_soft_tokens": 70, "pooling_kernel": 3}),
    "gemma4-e2b": ImageSpec(tiling="pooled_aspect", tile_size=48, patch_size=16, resample="bicubic",
                            rescale_factor=1 / 255, mean=[0.0] * 3, std=[1.0] * 3,
                            params={"max_soft_tokens": 280, "pooling_kernel": 3}),
}


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_preprocess_is_the_python_runtimes(page, spec, tmp_path):
    s = SPECS[spec]
    for name, im in _images(tmp_path).items():
        if spec in ("smolvlm-256m", "internvl3-1b") and name not in ("chelsea.png", "tall", "3x200", "700x2"):
            continue  # the real sizes on fewer images (each is up to 17 tiles of 512²)
        want = preprocess(im, s)
        digest, grid = _browser_preprocess(page, _png_uri(im), s)
        assert grid == want.grid, (spec, name)
        if digest != hashlib.sha256(want.pixels.tobytes()).hexdigest():
            got, _ = _browser_preprocess(page, _png_uri(im), s, full=True)
            bad = np.count_nonzero(got != want.pixels.ravel())
            pytest.fail(f"{spec} {name}: {bad} of {got.size} values differ")


def test_transparency_is_composited_onto_white(page):
    """Fully transparent and opaque pixels are exact; the canvas holds premultiplied pixels, so a half-transparent
    one may be off by a level or two (docs/browser.md)."""
    im = synthetic("rgba")  # alpha 0 in the top half, random alpha below
    s = SPECS["smolvlm-tiny"]
    want = preprocess(to_rgb(im), s)  # (the Python runtime composites in decode_image)
    got, grid = _browser_preprocess(page, _png_uri(im), s, full=True)
    assert grid == want.grid
    levels = np.abs(got - want.pixels.ravel()) / (2 / 255)  # in 8-bit levels (std 0.5: 1 level = 2/255)
    assert levels.max() <= 3.01, levels.max()
