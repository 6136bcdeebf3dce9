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


def _assert_pixels_equal(page, im: Image.Image, spec: ImageSpec, what: str) -> None:
    """The page's preprocessed pixels and grid are the Python runtime's, bit for bit (a digest first; on a mismatch
    the pixels themselves, to say how many values differ)."""
    want = preprocess(im, spec)
    digest, grid = _browser_preprocess(page, _png_uri(im), spec)
    assert grid == want.grid, what
    if digest != hashlib.sha256(want.pixels.tobytes()).hexdigest():
        got, _ = _browser_preprocess(page, _png_uri(im), spec, full=True)
        bad = np.count_nonzero(got != want.pixels.ravel())
        pytest.fail(f"{what}: {bad} of {got.size} values differ")


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
        _assert_pixels_equal(page, im, s, f"{spec} {name}")


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


# native resolution (static/image_native.js, runtime/media/image_native.py): the tiny Qwen3.5 / Qwen3-VL and Qwen2.5-VL
# bundles' specs (tests/fixtures_qwen.py) and Qwen3.5's released processor (patch 16, 65536..16777216 pixels) under
# a 1024-patch budget (a budget that cuts it: images_resized)
QWEN = dict(tiling="smart_resize", resample="bicubic", rescale_factor=1 / 255)
NATIVE_SPECS = {
    "qwen3.5-tiny": ImageSpec(tile_size=32, patch_size=16, mean=[0.5] * 3, std=[0.5] * 3, **QWEN, params={
        "merge": 2, "temporal_patch": 2, "min_pixels": 4096, "max_pixels": 65536, "max_patches": 256}),
    "qwen2.5-vl-tiny": ImageSpec(tile_size=28, patch_size=14, mean=[0.48145466, 0.4578275, 0.40821073],
                                 std=[0.26862954, 0.26130258, 0.27577711], **QWEN, params={
        "merge": 2, "temporal_patch": 2, "min_pixels": 3136, "max_pixels": 50176, "max_patches": 256}),
    "qwen3.5-released": ImageSpec(tile_size=32, patch_size=16, mean=[0.5] * 3, std=[0.5] * 3, **QWEN, params={
        "merge": 2, "temporal_patch": 2, "min_pixels": 65536, "max_pixels": 16777216, "max_patches": 1024}),
}


@pytest.mark.parametrize("spec", sorted(NATIVE_SPECS))
def test_native_resolution_patches_are_the_python_runtimes(page, spec, tmp_path):
    """Resized under the patch budget (smart_resize, with Python's round-half-even), normalized and cut into patch rows in
    merge-block order, bit for bit; an aspect ratio over 200:1 refused in both (fails on f2d6421: the page had no
    smart_resize op)."""
    s = NATIVE_SPECS[spec]
    # sides at k + 0.5 factors of 32 and of 28 (round-half-even: 2.5 -> 2, 4.5 -> 4)
    halves = {f"{w}x{h}": Image.fromarray(_rgb(w, h, w + h)) for w, h in ((144, 80), (70, 126))}
    for name, im in {**_images(tmp_path), **halves}.items():
        if name == "700x2":  # 350:1
            with pytest.raises(Exception, match="aspect ratio is 350:1"):
                preprocess(im, s)
            with pytest.raises(Exception, match="aspect ratio is 350:1"):
                _browser_preprocess(page, _png_uri(im), s)
            continue
        _assert_pixels_equal(page, im, s, f"{spec} {name}")


# the tiny bundles' vision params (Qwen2.5-VL: window attention; Qwen3-VL / Qwen3.5: the interpolated position table)
# and Qwen3.5's released tower's (head_dim 64, a 48² table)
VISION_PARAMS = {
    "window_order": {"ops": ["rotary_2d", "window_order"], "head_dim": 16, "theta": 10000.0, "merge": 2,
                     "window": 56, "patch": 14, "mask_value": -3.4028234663852886e38},
    "interpolated": {"ops": ["rotary_2d", "interpolated_positions"], "head_dim": 16, "theta": 10000.0, "merge": 2,
                     "position_side": 6, "mask_value": -3.4028234663852886e38},
    "interpolated-released": {"ops": ["rotary_2d", "interpolated_positions"], "head_dim": 64, "theta": 10000.0,
                              "merge": 2, "position_side": 48, "mask_value": -3.4028234663852886e38},
}


@pytest.mark.parametrize("params", sorted(VISION_PARAMS))
def test_native_vision_inputs_are_the_python_runtimes(page, params):
    """The vision graph's inputs for an image's grid (rows padded to the budget, 2-D rotary, window order and masks or
    the position table's taps and weights, the attention mask) and the token order, bit for bit (fails on f2d6421:
    the page had no native_grid op)."""
    from vlmrt.runtime.media.vision_inputs import build_feeds

    p, rows, row_len = VISION_PARAMS[params], 256, 12
    for gh, gw in ((2, 2), (4, 14), (16, 6), (10, 12), (2, 128), (16, 16)):
        x = np.random.default_rng(gh * gw).standard_normal((gh * gw, row_len)).astype(np.float32)
        want = build_feeds(x, (1, gh, gw), p["ops"], p, rows, p["mask_value"])
        got = page.evaluate(f"""async ([x, grid, p, rows, len]) => {{
            const {{ nativeGridFeeds }} = await import('/image_native.js');
            const b64 = {B64}, tob64 = {TO_B64};
            const f = nativeGridFeeds(new Float32Array(b64(x).buffer), grid, p, rows, len);
            const feeds = {{}};
            for (const [k, [type, data, dims]] of Object.entries(f.feeds)) feeds[k] = [type, tob64(new Uint8Array(data.buffer)), dims];
            return [feeds, f.tokens, f.order];
        }}""", [base64.b64encode(x.tobytes()).decode(), [gh, gw], p, rows, row_len])
        feeds, tokens, order = got
        assert tokens == want.tokens and sorted(feeds) == sorted(want.feeds), (gh, gw)
        assert order == (None if want.token_order is None else want.token_order.tolist()), (gh, gw)
        for k, (dtype, data, dims) in feeds.items():
            js = np.frombuffer(base64.b64decode(data), {"float32": np.float32, "int64": np.int64}[dtype]).reshape(dims)
            w = want.feeds[k]
            assert js.dtype == w.dtype and js.shape == w.shape, (k, gh, gw)
            bad = np.count_nonzero(js != w)
            assert bad == 0, f"{params} {gh}x{gw} {k}: {bad} of {js.size} values differ"


def test_mrope_positions_are_the_python_runtimes(page):
    """static/positions.js's mrope op against runtime/prompt/mrope.py on a prompt with a wide and a tall image (text
    before, between and after), and the step positions after it: each row one past the last slot's largest (fails on
    f2d6421: the page had no positions op)."""
    from vlmrt.runtime.prompt.mrope import mrope_rows, next_position

    n, runs, grids = 120, [(5, 59), (70, 82)], [(6, 9), (4, 3)]  # (rows, cols) in tokens
    want = mrope_rows(n, runs, [(1, r, c) for r, c in grids], 1)
    got = page.evaluate("""async ([n, runs, grids]) => {
        const m = await import('/positions.js');
        const images = runs.map(([a, b], i) => ({ slots: Array.from({ length: b - a }, (_, k) => a + k), rows: grids[i][0], cols: grids[i][1] }));
        const p = m.promptPositions('mrope', 3, n, images);
        const next = m.positionAfter(p, 3, n, n);
        return [Array.from(p, Number), next, Array.from(m.stepPositions(null, 3, 1, 2, next), Number)];
    }""", [n, runs, grids])
    assert np.array_equal(np.array(got[0]).reshape(3, n), want)
    assert got[1] == next_position(want[:, -1:]) and got[2] == [got[1], got[1] + 1] * 3
