"""The committed bad-input corpus (tests/corpus/): every image, video, bundle change and prompt there, with its expected
outcome — it works, or vlmrt refuses it with one `vlmrt: error:` line holding the expected words."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_errors import assert_one_line_error, in_process
from vlmrt.format import manifest as mf
from vlmrt.runtime.media import image as img_ops
from vlmrt.runtime.media import video as V

CORPUS = Path(__file__).resolve().parent / "corpus"
IMAGES = json.loads((CORPUS / "images.json").read_text())
BUNDLES = {k: v for k, v in json.loads((CORPUS / "bundles.json").read_text()).items() if not k.startswith("_")}
PROMPTS = {k: v for k, v in json.loads((CORPUS / "prompts.json").read_text()).items() if not k.startswith("_")}
VIDEOS = json.loads((CORPUS / "videos.json").read_text())
NOT_A_VIDEO = "not a video format vlmrt reads"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_corpus(name, default_bundle):
    case, path = IMAGES[name], CORPUS / "images" / name
    if case["expect"] == "ok":
        im = img_ops.load_image(path)
        assert im.mode == "RGB" and list(im.size) == case["size"]
        spec = mf.load(default_bundle.bundle, verify=False).image
        tiles = img_ops.preprocess(im, spec)
        assert tiles.pixels.shape[1:] == (3, spec.tile_size, spec.tile_size) and np.isfinite(tiles.pixels).all()
    else:
        with pytest.raises(img_ops.ImageError, match=case["expect"]):
            img_ops.load_image(path)


@pytest.mark.parametrize("name", ["bomb_400mp.png", "big_121mp.png", "truncated.jpg", "text.jpg"])
def test_bad_images_on_the_command_line(name, default_bundle, capsys):
    p = in_process(capsys, "run", default_bundle.bundle, "--image", CORPUS / "images" / name, "--prompt", "hi")
    assert_one_line_error(p, IMAGES[name]["expect"])


def test_image_over_the_byte_limit_is_refused_unread(tmp_path, capsys, default_bundle):
    big = tmp_path / "big.png"
    with open(big, "wb") as f:  # sparse: a PNG signature, then a hole up to the limit + 1 byte
        f.write(b"\x89PNG\r\n\x1a\n")
        f.truncate(img_ops.MAX_IMAGE_BYTES + 1)
    p = in_process(capsys, "run", default_bundle.bundle, "--image", big, "--prompt", "hi")
    assert_one_line_error(p, "MiB; vlmrt reads images up to 100 MiB")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_transformers(orientation):
    """transformers' load_image (what the model cards use) applies the EXIF orientation: same pixels."""
    from transformers.image_utils import load_image as hf_load_image

    path = CORPUS / "images" / f"exif_orientation_{orientation}.jpg"
    ours, theirs = img_ops.load_image(path), hf_load_image(str(path))
    assert ours.size == theirs.size
    assert np.array_equal(np.asarray(ours), np.asarray(theirs.convert("RGB")))


def test_exif_orientations_are_all_different():
    """The corpus images really exercise eight different transforms (the test above would pass on ignored tags)."""
    arrays = [np.asarray(img_ops.load_image(CORPUS / "images" / f"exif_orientation_{o}.jpg")) for o in range(1, 9)]
    assert len({(a.shape, a[0, 0].tobytes(), a[-1, -1].tobytes(), a[0, -1].tobytes()) for a in arrays}) == 8


@pytest.fixture
def containers(monkeypatch):
    """Every container vlmrt opens through PyAV, with the format it named (av.open recorded)."""
    av = pytest.importorskip("av")
    opened = []
    real = av.open

    def record(file, *a, **kw):
        c = real(file, *a, **kw)
        opened.append((kw.get("format"), c))
        return c

    monkeypatch.setattr(av, "open", record)
    return opened


@pytest.mark.parametrize("name", sorted(VIDEOS))
def test_video_corpus(name, containers):
    """Each file read as a video (issue 43): the allowed containers (MP4 / MOV, WebM / MKV, AVI) give their frames; an
    SDP session, an HLS playlist, a concat script, an MPEG-TS stream or text is refused from its first bytes, before
    FFmpeg sees it (no av.open at all: FFmpeg's probing would have picked the sdp / hls / concat demuxers, which open
    sockets and other files); a damaged file of an allowed container is one error; quickly, and every container that
    was opened is closed again, whichever way the read ended."""
    case, path = VIDEOS[name], CORPUS / "videos" / name
    t = time.monotonic()
    if case["expect"] == "ok":
        clip = V.read_video(path)
        frames = clip.frames(np.arange(clip.total_frames))
        assert clip.total_frames == len(frames) == case["frames"] and clip.fps == 10.0
        levels = [int(np.asarray(f)[16, 24, 0]) for f in (frames[0], frames[-1])]
        assert abs(levels[0] - 0) <= 8 and abs(levels[1] - 220) <= 8, levels  # the first and last grey levels
        assert containers and all(fmt in V.PYAV_FORMATS for fmt, _ in containers)
    else:
        with pytest.raises(V.VideoError, match=case["expect"]):
            clip = V.read_video(path)
            clip.frames(np.arange(clip.total_frames))
        if case["expect"] == NOT_A_VIDEO:
            assert containers == []
    assert time.monotonic() - t < 5
    assert all(not c.input_was_opened for _, c in containers), "a container left open"


@pytest.mark.parametrize("name", ["stream.sdp", "playlist.m3u8", "list.ffconcat", "truncated.mp4"])
def test_bad_videos_on_the_command_line(name, default_bundle, capsys):
    p = in_process(capsys, "run", default_bundle.bundle, "--video", CORPUS / "videos" / name, "--prompt", "hi")
    assert_one_line_error(p, "cannot read video", VIDEOS[name]["expect"])


def test_video_decoding_is_bounded(monkeypatch):
    """Each decoding pass stops at MAX_DECODE_S seconds and MAX_SOURCE_FRAMES frames, as one error: reading the frames,
    and counting them (a Matroska file records no frame count)."""
    mp4, mkv = CORPUS / "videos" / "ok.mp4", CORPUS / "videos" / "ok.mkv"
    clip = V.read_video(mp4)  # the header only
    monkeypatch.setattr(V, "MAX_DECODE_S", -1.0)
    with pytest.raises(V.VideoError, match="not decoded within"):
        clip.frames(np.array([11]))
    with pytest.raises(V.VideoError, match="not decoded within"):
        V.read_video(mkv)
    monkeypatch.setattr(V, "MAX_DECODE_S", 120.0)
    monkeypatch.setattr(V, "MAX_SOURCE_FRAMES", 5)
    with pytest.raises(V.VideoError, match="more than 5 frames"):
        V.read_video(mkv)
    monkeypatch.setattr(V, "MAX_FRAME_PIXELS", 48 * 32 - 1)
    with pytest.raises(V.VideoError, match="48×32 frames"):
        V.read_video(mp4)


def _get(d, dotted):
    *head, last = dotted.split(".")
    for k in head:
        d = d[int(k)] if isinstance(d, list) else d[k]
    return d, (int(last) if isinstance(d, list) else last)


def make_bad_bundle(src: Path, tmp: Path, case: dict) -> Path:
    b = tmp / "bundle"
    shutil.copytree(src, b)
    manifest = b / "manifest.json"
    m = json.loads(manifest.read_text())
    if "delete" in case:
        os.remove(b / case["delete"])
    if "truncate" in case:
        p = b / case["truncate"]
        os.truncate(p, p.stat().st_size // 2)
    if "flip_byte" in case:
        with open(b / case["flip_byte"], "r+b") as f:
            f.seek(100)
            x = f.read(1)
            f.seek(100)
            f.write(bytes([x[0] ^ 1]))
    if "write_manifest" in case:
        manifest.write_text(case["write_manifest"])
    if "write_manifest_repeat" in case:
        text, n = case["write_manifest_repeat"]
        manifest.write_text(text * n)
    if "write_manifest_hex" in case:
        manifest.write_bytes(bytes.fromhex(case["write_manifest_hex"]))
    edits = False
    for dotted, value in case.get("set", []):
        d, k = _get(m, dotted)
        d[k] = value
        edits = True
    if "drop" in case:
        d = m
        for k in case["drop"][:-1]:
            d = d[k]
        del d[case["drop"][-1]]
        edits = True
    if "rename_file_entry" in case:
        old, new = case["rename_file_entry"]
        m["files"][new] = m["files"].pop(old)
        edits = True
    if "escape" in case:  # a tokenizer outside the bundle, listed with its own sha256
        elsewhere = tmp / "elsewhere"
        elsewhere.mkdir()
        shutil.copyfile(b / "tokenizer.json", elsewhere / "tokenizer.json")
        entry = m["files"].pop("tokenizer.json")
        if case["escape"] == "dotdot":
            m["tokenizer_file"] = "../elsewhere/tokenizer.json"
        elif case["escape"] == "absolute":
            m["tokenizer_file"] = str(elsewhere / "tokenizer.json")
        else:
            os.remove(b / "tokenizer.json")
            os.symlink(elsewhere / "tokenizer.json", b / "tokenizer.json")
        m["files"][m["tokenizer_file"]] = entry
        edits = True
    if edits:
        manifest.write_text(json.dumps(m))
    return b


@pytest.mark.parametrize("name", sorted(BUNDLES))
def test_bundle_corpus(name, default_bundle, tmp_path, capsys):
    b = make_bad_bundle(default_bundle.bundle, tmp_path, BUNDLES[name])
    p = in_process(capsys, "run", b, "--prompt", "hi", "--image", CORPUS / "images" / "one_pixel.png",
                   "--max-new-tokens", 2)
    assert_one_line_error(p, *BUNDLES[name]["expect"])


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_escaping_paths_are_refused_before_opening(escape, default_bundle, tmp_path, monkeypatch):
    """The path check comes before any file is hashed or opened (not the sha256 that stops it)."""
    b = make_bad_bundle(default_bundle.bundle, tmp_path, {"escape": escape})
    opened = []
    monkeypatch.setattr(mf, "sha256_file", lambda p: opened.append(p) or "0")
    with pytest.raises(mf.BundleError, match="manifest field tokenizer_file"):
        mf.load(b)
    assert opened == []


def _prompt(case: dict) -> bytes:
    if "prompt_hex" in case:
        return bytes.fromhex(case["prompt_hex"])
    if "prompt_repeat" in case:
        text, n = case["prompt_repeat"]
        return (text * n).encode()
    return case["prompt"].encode()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_corpus(name, default_bundle):
    """Through a real argv (bytes: invalid UTF-8 reaches Python as it would from a shell)."""
    case = PROMPTS[name]
    prompt = _prompt(case)
    if name == "100kB":
        assert len(prompt) >= 100_000
    p = subprocess.run([sys.executable, "-m", "vlmrt.cli", "run", str(default_bundle.bundle).encode(), b"--prompt", prompt,
                        b"--max-new-tokens", b"2", b"--json"], capture_output=True, timeout=300)
    p = subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode(errors="replace"))
    if case["expect"] == "ok":
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["prompt_tokens"] > 0
    else:
        assert_one_line_error(p, *case["expect"])


def test_a_file_that_is_no_image_is_named_plainly(tmp_path, capsys, default_bundle):
    """Pillow's "cannot identify image file <_io.BytesIO object at 0x7f...>" (a memory address, the image read from bytes)
    is said as what it means, for files, data URIs and empty files."""
    import base64

    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    for src, words in ((CORPUS / "images" / "text.jpg", "not an image format Pillow reads"), (empty, "the file is empty"),
                       ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "data URI: not an image format")):
        p = in_process(capsys, "run", default_bundle.bundle, "--image", src, "--prompt", "hi")
        assert_one_line_error(p, "cannot read image", words)
        assert "BytesIO" not in p.stderr and " at 0x" not in p.stderr


def test_bad_paths_on_the_command_line(default_bundle, tmp_path, capsys):
    """A 300-character name, a 5,000-character path and a symbolic link loop given to --image or --video, and a NUL byte
    in a --messages file's image path: one short `vlmrt: error:` line each (a name too long used to print the OS's
    error with the whole path, 5,000 characters and more)."""
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    sources = [tmp_path / ("x" * 300 + ".png"), tmp_path / "/".join(["d" * 50] * 100), tmp_path / "loop1",
               tmp_path / "loop1" / "x.png"]
    for flag in ("--image", "--video"):
        for src in sources:
            p = in_process(capsys, "run", default_bundle.bundle, flag, src, "--prompt", "hi")
            assert_one_line_error(p, "image" if flag == "--image" else "video")
            assert len(p.stderr.strip()) < 320, p.stderr[:200]
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a\u0000b.png"}},
                                                             {"type": "text", "text": "hi"}]}]))
    p = in_process(capsys, "run", default_bundle.bundle, "--messages", conv)
    assert_one_line_error(p, "image")
