"""Decoded-size amplification (issue 43 item 6; docs/limits.md, "Decoded pixels"): images are refused from their
headers, before any pixel is decoded, over the per-image and per-prompt pixel limits (`--max-pixels` of run, chat and
batch); a large JPEG that the processor shrinks a lot is decoded smaller (Image.draft) without changing the answer.
The server's budgets are tested in test_serve_security.py."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

import amplify
from test_errors import assert_one_line_error, in_process
from vlmrt.format import manifest as mf
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.vlm import VLM


@pytest.mark.parametrize("fmt", sorted(amplify.FORMATS))
def test_huge_headers_are_refused_before_decoding(fmt):
    """Every format: a file of a few bytes declaring 9000 × 9000 (81 MP) is measured from its header (probe_image:
    no pixel decoded) and refused under a smaller limit at once, and the process's memory does not grow (a decode
    would allocate 81 to 243 MB: WebP decodes this one whole, as RGB, in ~3 s)."""
    data = amplify.FORMATS[fmt](9000, 9000)
    assert len(data) < 16_000
    head = img_ops.probe_image(data, fmt)
    assert head.size == (9000, 9000) and head.pixels == 81_000_000
    t = time.perf_counter()
    with pytest.raises(img_ops.TooManyPixels, match="9000×9000 pixels; vlmrt reads images up to 64 million"):
        amplify.peak_growth_mb(lambda: img_ops.decode_image(data, fmt, max_pixels=64_000_000))
    assert time.perf_counter() - t < 1.0
    _, grown = amplify.peak_growth_mb(lambda: pytest.raises(img_ops.TooManyPixels, img_ops.decode_image, data, fmt,
                                                            max_pixels=64_000_000))
    assert grown < 40, f"{grown:.0f} MB"


def test_png_bomb_within_the_old_per_image_limit():
    """The issue's file: a 14.5 KB PNG of 10900 × 10900 (118.8 MP, under the 120 MP per-image limit), refused by a
    prompt limit below it from its header, in well under a second (decoding it took 2.2 GB and ~20 s)."""
    data = amplify.png(10900, 10900)
    assert len(data) < 16_000
    (err, grown) = amplify.peak_growth_mb(lambda: pytest.raises(img_ops.TooManyPixels, img_ops.decode_image, data,
                                                                "bomb.png", max_pixels=100_000_000))
    assert "10900×10900" in str(err.value) and grown < 40


def _two_pngs(tmp_path):
    paths = []
    for i in range(2):
        p = tmp_path / f"im{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (700, 1000, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


def test_run_max_pixels(default_bundle, tmp_path, capsys):
    """vlmrt run: two 0.7 MP images are refused under --max-pixels 1 (together 1.4 MP) with one line naming the
    option, one of them passes it, and --max-pixels 0.5 refuses that one alone (its size named)."""
    a, b = _two_pngs(tmp_path)
    base = ["run", default_bundle.bundle, "--prompt", "hi", "--max-new-tokens", "2"]
    p = in_process(capsys, *base, "--image", a, "--image", b, "--max-pixels", "1")
    assert_one_line_error(p, "the prompt's 2 images decode to 1.4 million pixels together", "up to 1 million",
                          "--max-pixels")
    assert in_process(capsys, *base, "--image", a, "--max-pixels", "1").returncode == 0
    p = in_process(capsys, *base, "--image", a, "--max-pixels", "0.5")
    assert_one_line_error(p, "is 1000×700 pixels; vlmrt reads images up to 0.5 million pixels", "--max-pixels")
    p = in_process(capsys, *base, "--image", a, "--max-pixels", "nan")
    assert_one_line_error(p, "--max-pixels must be")


def test_batch_max_pixels(default_bundle, tmp_path, capsys):
    """vlmrt batch --max-pixels: a record over it is its error line; the others are answered."""
    import json

    a, b = _two_pngs(tmp_path)
    records = tmp_path / "in.jsonl"
    records.write_text(json.dumps({"id": "two", "image": [str(a), str(b)], "prompt": "hi"}) + "\n"
                       + json.dumps({"id": "one", "image": str(a), "prompt": "hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    p = in_process(capsys, "batch", default_bundle.bundle, "--input", records, "--output", out, "--quiet",
                   "--max-new-tokens", "2", "--max-pixels", "1")
    assert p.returncode == 0, p.stderr
    lines = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "decode to 1.4 million pixels together" in lines["two"]["error"]
    assert "text" in lines["one"]


def photo_jpeg(w: int, h: int) -> bytes:
    """A photo-like JPEG (the rocket upscaled, with noise), as benchmarks/jpeg_draft.py makes them."""
    from conftest import ASSETS

    rng = np.random.default_rng(0)
    im = Image.open(ASSETS / "rocket.jpg").convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
    x = (np.asarray(im, np.int16) + rng.normal(0, 8, (h, w, 3)).astype(np.int16)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(x).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_large_jpeg_is_drafted_and_answers_as_decoded_whole(default_bundle, tmp_path):
    """A 6000 × 4000 JPEG (24 MP) for the fixture's processor (longest edge 192: it resizes to 192 × 128) is decoded at
    1/8 (750 × 500, 0.375 MP: still over twice 192 × 128 a side), the processor decides its grid from the source size,
    its tiles are within a few levels of the whole decode's (measured: max 2.3, mean 0.25), and teacher-forced along
    the whole decode's 12 greedy ids the logits are within 0.25 (measured 0.18 on this random model, logits of std 1)
    with the same choice at every step decided by more than that (free-running, its answer parts at a 0.003 tie)."""
    spec = mf.load(default_bundle.bundle, verify=False).image
    path = tmp_path / "photo.jpg"
    path.write_bytes(photo_jpeg(6000, 4000))
    head = img_ops.probe_image(path.read_bytes(), "photo", spec)
    assert head.decoded == (750, 500) and head.size == (6000, 4000)
    drafted, whole = img_ops.decode_image(path.read_bytes(), "photo", spec), img_ops.load_image(path)
    assert drafted.size == (750, 500) and img_ops.source_size(drafted) == (6000, 4000) and whole.size == (6000, 4000)
    a, b = img_ops.preprocess(drafted, spec), img_ops.preprocess(whole, spec)
    assert a.grid == b.grid
    levels = np.abs(a.pixels - b.pixels) * 0.5 * 255  # normalize undone: mean / std 0.5
    assert levels.max() < 8 and levels.mean() < 1.0, (levels.max(), levels.mean())
    vlm = VLM.load(default_bundle.bundle)
    want = vlm("What is this?", whole, max_new_tokens=12, ignore_eos=True).token_ids
    rows = {}
    for key, im in (("drafted", str(path)), ("whole", whole)):  # a path is drafted; a PIL image is used as it is
        rows[key] = vlm.row.score(vlm.embed_prompt(vlm.prompt("What is this?", [im])), want).astype(np.float32)
    assert np.abs(rows["drafted"] - rows["whole"]).max() < 0.25
    top2 = np.sort(rows["whole"], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.25
    assert clear.sum() >= 6
    assert (rows["drafted"].argmax(-1)[clear] == np.array(want)[clear]).all()


def test_draft_rule():
    """Drafted only over 16 MP and only as far as keeps twice the processor's size: a 12 MP photo and a 24 MP one
    for SmolVLM-256M's 2048 px are decoded whole (pixels equal to transformers' load_image); a 108 MP one at 1/2."""
    mean = [0.5] * 3
    smolvlm = mf.ImageSpec("longest_edge_grid", 512, 16, "lanczos", 1 / 255, mean, mean,
                           {"longest_edge": 2048, "split": True})
    assert img_ops.draft_request(smolvlm, 4032, 3024) is None  # 12 MP
    assert img_ops.draft_request(smolvlm, 6000, 4000) is None  # 24 MP: 6000 // 4096 = 1
    assert img_ops.draft_request(smolvlm, 12000, 9000) == (4096, 3072)  # 108 MP: decoded at 1/2, 6000 × 4500
    qwen = mf.ImageSpec("smart_resize", 28, 14, "bicubic", 1 / 255, mean, mean,
                        {"merge": 2, "temporal_patch": 2, "min_pixels": 3136, "max_pixels": 12845056,
                         "max_patches": 4096})
    assert img_ops.draft_request(qwen, 4032, 3024) is None  # 12 MP: never
    assert img_ops._draft_scale(6000, 4000, img_ops.draft_request(qwen, 6000, 4000)) == 2
