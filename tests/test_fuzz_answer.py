"""Fuzzing past the parsers (test_fuzz.py stops at manifest.load and load_image): manifests that load but disagree
with the bundle's graphs, tables or tokenizer (layers, max_context, tokens per tile, vocab, ...) go through
`vlmrt run` (VLM.load + one answer with an image): each either answers exactly as the intact bundle does or is
refused in one `vlmrt: error:` line, never a traceback or another answer; and images of any size, aspect ratio
and mode go through both tiling ops and, for some, through an answer."""

from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import pytest
from PIL import Image

from vlmrt import cli
from vlmrt.format import manifest as mf
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.vlm import VLM

IMAGE = None  # set by the fixture: the picture every answer is about

# (path in manifest.json, values): each loads (the schema takes it) but disagrees with the bundle
class Edit:
    """A value computed from the field's own (a list shortened or grown), named for the test id."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __repr__(self):
        return self.name


def _drop_last(layers):
    return layers[:-1]


def _repeat_first(layers):
    return [layers[0], *layers]


MUTATIONS = [
    (("kv", "layers"), [Edit("drop_last", _drop_last), Edit("repeat_first", _repeat_first)]),
    (("kv", "max_context"), [40, 321]),
    (("kv", "layers", 0, "kv_heads"), [4]),
    (("kv", "layers", 0, "head_dim"), [8]),
    (("kv", "layers", 1, "key_input"), ["past_key_0"]),
    (("prompt", "tokens_per_tile"), [15, 0]),
    (("decoder", "vocab_size"), [519]),
    (("decoder", "hidden_size"), [32]),
    (("decoder", "prefill_ar"), [7]),
    (("special_tokens", "image_token_id"), [0, 519]),
    (("special_tokens", "eos_token_ids"), [[], [10**6]]),
    (("image", "tile_size"), [128]),
    (("image", "patch_size"), [16]),
    (("graphs", "vision", "outputs", 0, "shape"), [[15, 64]]),
    (("graphs", "vision", "inputs", 0, "shape"), [[16, 192]]),
]
SINGLE = [(path, v) for path, values in MUTATIONS for v in values]


def combos(n: int, seed: int = 37) -> list[list[tuple]]:
    rnd = random.Random(seed)
    return [rnd.sample(SINGLE, 2) for _ in range(n)]


CASES = [[m] for m in SINGLE] + combos(6)


def mutate(d: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        d = d[k]
    assert path[-1] in d if isinstance(d, dict) else path[-1] < len(d), path  # the field exists (not silently added)
    d[path[-1]] = value.fn(d[path[-1]]) if isinstance(value, Edit) else value


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """(bundle, its answer's token ids) of the fixture bundle, and the image file."""
    from conftest import CASES as FIXTURES, exported

    ex = exported(FIXTURES[0], tmp_path_factory)
    img = tmp_path_factory.mktemp("img") / "picture.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 96, 3), dtype=np.uint8)).save(img)
    vlm = VLM.load(ex.bundle)
    want = vlm("What is in the picture?", str(img), max_new_tokens=4, ignore_eos=True).token_ids
    return ex.bundle, img, want


def run_json(capsys, bundle, img) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["run", str(bundle), "--prompt", "What is in the picture?", "--image", str(img),
                     "--max-new-tokens", "4", "--ignore-eos", "--json"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("muts", CASES, ids=lambda ms: "+".join(f"{'.'.join(map(str, p))}={v}" for p, v in ms))
def test_inconsistent_manifest_answers_right_or_is_one_line(intact, muts, capsys, tmp_path):
    bundle, img, want = intact
    d = json.loads((bundle / "manifest.json").read_text())
    base = copy.deepcopy(d)
    for path, value in muts:
        mutate(d, path, value)
    assert d != base
    b = tmp_path / "b"
    b.mkdir()
    for f in os.listdir(bundle):
        if f != "manifest.json":
            os.link(bundle / f, b / f)  # the same files (hard links: no copy), another manifest
    (b / "manifest.json").write_text(json.dumps(d))
    code, out, err = run_json(capsys, b, img)
    assert "Traceback" not in err
    if code == 0:
        got = json.loads(out.strip().splitlines()[-1])["token_ids"]
        assert got == want, "a manifest that disagrees with its bundle gave another answer instead of an error"
    else:
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("vlmrt: error: "), err


# ------------------------------------------------------------------------- images through tiling


def random_image(rnd: random.Random) -> Image.Image:
    kind = rnd.choice(["tiny", "thin", "tall", "any", "big"])
    h, w = {"tiny": lambda: (rnd.randint(1, 4), rnd.randint(1, 4)),
            "thin": lambda: (rnd.randint(1, 3), rnd.randint(200, 3000)),
            "tall": lambda: (rnd.randint(200, 3000), rnd.randint(1, 3)),
            "any": lambda: (rnd.randint(1, 700), rnd.randint(1, 700)),
            "big": lambda: (rnd.randint(1000, 2500), rnd.randint(1000, 2500))}[kind]()
    mode = rnd.choice(["RGB", "L", "LA", "RGBA", "P", "1", "I;16", "I", "F", "CMYK", "YCbCr"])
    rng = np.random.default_rng(rnd.randint(0, 10**6))
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    if mode == "P":
        return im.quantize(8)
    if mode in ("I;16", "I", "F"):
        return Image.fromarray((rng.random((h, w)) * 60000).astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]))
    return im.convert(mode)


def tiling_specs(bundle):
    from test_tiling import internvl_spec

    return {"longest_edge_grid": mf.load(bundle).image, "closest_aspect_grid": internvl_spec(448, 12)}


def test_fuzzed_images_through_both_tilings(intact):
    """200 random images (1x1 to 2500x2500, 1:3000 aspect ratios, 11 modes) through each tiling op: a grid whose
    tile count is what the op promises, tiles of the spec's size, finite values in the normalized range."""
    specs = tiling_specs(intact[0])
    rnd = random.Random(11)
    for i in range(200):
        im = random_image(rnd)
        rgb = img_ops.to_rgb(im)
        assert rgb.mode == "RGB" and rgb.size == im.size
        for name, spec in specs.items():
            t = img_ops.preprocess(rgb, spec)
            rows, cols, tiles = t.grid
            s = spec.tile_size
            assert t.pixels.shape == (tiles, 3, s, s), (i, im.size, im.mode, name)
            assert np.isfinite(t.pixels).all()
            lo = min((0 - m) / sd for m, sd in zip(spec.mean, spec.std))
            hi = max((1 - m) / sd for m, sd in zip(spec.mean, spec.std))
            assert lo - 1e-5 <= t.pixels.min() and t.pixels.max() <= hi + 1e-5
            if name == "longest_edge_grid":  # the grid's tiles, then the global image (when split)
                assert tiles == (rows * cols + 1 if rows * cols > 1 else 1)
            else:  # closest_aspect_grid: rows x cols within [min, max] tiles, a thumbnail when more than one
                assert 1 <= rows * cols <= 12 and tiles == rows * cols + (rows * cols > 1)


def test_fuzzed_images_answer_with_their_token_count(intact):
    """Some of them through an answer: the prompt holds tokens_per_tile image tokens per tile of the image's grid."""
    bundle = intact[0]
    vlm = VLM.load(bundle)
    m = vlm.manifest
    rnd = random.Random(12)
    for i in range(8):
        im = random_image(rnd)
        r = vlm("What is it?", im, max_new_tokens=1)
        grid = img_ops.preprocess(img_ops.to_rgb(im), m.image).grid
        assert r.prompt_ids.count(m.special_tokens.image_token_id) == grid[2] * m.prompt.tokens_per_tile, im.size
        assert r.stats.image_tiles == grid[2] and len(r.token_ids) <= 1
