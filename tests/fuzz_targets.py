"""Property-based fuzzing (hypothesis) of the loaders that read untrusted files: the manifest loader
(vlmrt.format.manifest.load), the image loader (vlmrt.runtime.media.image.load_image) and the video reader
(vlmrt.runtime.media.video.read_video on bytes). For any input they either work or raise vlmrt's own error (BundleError /
ImageError / VideoError) — never another exception — and what they accept stays within the rules (bundle paths inside
the bundle; images RGB, at most MAX_IMAGE_PIXELS; videos decoded only by the allowed demuxers, every container closed).
And the prompt builder on untrusted message text (prompt_property): a control token's string in it never
becomes that token. Used by tests/test_fuzz.py (a short run) and benchmarks/fuzz.py (the long run)."""

from __future__ import annotations

import io
import json
import struct
import tempfile
import zlib
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrt.format import manifest as mf
from vlmrt.runtime.media import image as img_ops

CORPUS = Path(__file__).resolve().parent / "corpus" / "images"
PATHISH = ["..", "../x", "/etc/passwd", "a/../../b", "./tokenizer.json", "tokenizer.json/", "", "\x00", "a\\..\\b",
           "~", "//x", "x" * 300, "embed.npy", "decoder.data", "vision.onnx", "link_out", "loop"]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64), st.sampled_from([10**400, -10**400]), st.floats(allow_nan=True),
                      st.text(max_size=20), st.sampled_from(PATHISH))
json_value = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                          max_leaves=12)


def _paths(d, prefix=()):
    """Every key path into a JSON tree."""
    out = []
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


@st.composite
def mutated_manifest(draw, base: dict) -> bytes:
    m = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(m)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "replace", "path", "delete", "add"]))
        if action == "delete":
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_value)
        elif action == "path":
            parent[path[-1]] = draw(st.sampled_from(PATHISH))
        else:
            parent[path[-1]] = draw(json_value)
    return json.dumps(m).encode()


def manifest_inputs(base: dict):
    raw = st.one_of(st.binary(max_size=200), json_value.map(lambda v: json.dumps(v).encode()))
    return st.one_of(mutated_manifest(base), mutated_manifest(base), raw)


def prepare_bundle_copy(bundle: Path, dst: Path) -> Path:
    """A copy of the bundle with a symlink leaving it and a loop. Hard links for the files the loader only reads; a
    real copy of manifest.json, which check_manifest rewrites (through a link it would rewrite the original's)."""
    import os
    import shutil

    shutil.copytree(bundle, dst, copy_function=os.link)
    os.unlink(dst / mf.MANIFEST_NAME)
    shutil.copyfile(bundle / mf.MANIFEST_NAME, dst / mf.MANIFEST_NAME)
    os.symlink("/etc/passwd", dst / "link_out")
    os.symlink(dst / "loop", dst / "loop")
    return dst


def check_manifest(folder: Path, data: bytes, counter: list | None = None) -> None:
    """The property: mf.load either returns a manifest whose every path stays in the folder, or raises BundleError."""
    if counter is not None:
        counter[0] += 1
    (folder / mf.MANIFEST_NAME).write_bytes(data)
    try:
        m = mf.load(folder, verify=True)
    except mf.BundleError as e:
        assert str(e).strip(), "an empty error message"
        return
    root = folder.resolve()
    for field, name in mf.bundle_paths(m):
        assert (folder / name).resolve().is_relative_to(root), (field, name)


def manifest_property(base: dict, folder: Path, max_examples: int, counter: list | None = None, seed: int | None = None):
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(manifest_inputs(base))
    def prop(data):
        check_manifest(folder, data, counter)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop


# ---------------------------------------------------------------- images

def _png(w: int, h: int, mode_bits: tuple[int, int], body: bytes) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    depth, color = mode_bits
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(body)) + chunk(b"IEND", b""))


def _seeds() -> list[bytes]:
    from PIL import Image

    seeds = [p.read_bytes() for p in sorted(CORPUS.iterdir()) if p.stat().st_size < 20000 and p.stat().st_size > 0]
    im = Image.new("RGB", (9, 7), (10, 20, 30))
    for fmt in ("BMP", "TIFF", "WEBP", "ICO", "PPM", "TGA"):
        b = io.BytesIO()
        try:
            im.save(b, fmt)
        except (KeyError, OSError):
            continue
        seeds.append(b.getvalue())
    return seeds


SEEDS = _seeds()


@st.composite
def mutated_image(draw) -> bytes:
    return _mutated(draw, SEEDS)


def _mutated(draw, seeds: list[bytes]) -> bytes:
    """One of seeds with up to 8 bytes changed, then perhaps truncated."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 8))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


png_headers = st.builds(_png, st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1),
                        st.sampled_from([(1, 0), (8, 0), (16, 0), (8, 2), (8, 3), (8, 4), (8, 6), (16, 6), (3, 3)]),
                        st.binary(max_size=64))
image_inputs = st.one_of(st.binary(max_size=300), mutated_image(), mutated_image(), png_headers)


def check_image(path: Path, data: bytes, counter: list | None = None) -> None:
    if counter is not None:
        counter[0] += 1
    path.write_bytes(data)
    try:
        im = img_ops.load_image(path)
    except img_ops.ImageError as e:
        assert str(e).strip()
        return
    assert im.mode == "RGB" and im.width >= 1 and im.height >= 1
    assert im.width * im.height <= img_ops.MAX_IMAGE_PIXELS


def image_property(folder: Path, max_examples: int, counter: list | None = None, seed: int | None = None):
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(image_inputs)
    def prop(data):
        check_image(folder / "image", data, counter)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop


# ---------------------------------------------------------------- decompression amplification

@st.composite
def huge_headers(draw) -> tuple[str, int, int, int]:
    """(format, width, height, a decoded-pixel limit below width × height): a few bytes (tests/amplify.py) declaring an
    image of up to 65535 a side (WebP: 16384) in one of the formats a client can send."""
    import amplify

    fmt = draw(st.sampled_from(sorted(amplify.FORMATS)))
    side = 16384 if fmt == "webp" else 65535
    w, h = draw(st.integers(1, side)), draw(st.integers(1, side))
    if w * h < 2:
        w = 2
    return fmt, w, h, draw(st.integers(1, w * h - 1))


def check_amplification(fmt: str, w: int, h: int, limit: int, counter: list | None = None) -> None:
    """The property: the header gives the declared size without decoding (or the image is refused: over Pillow's own
    bomb limit, a header the format rejects), and under a smaller pixel limit decode_image refuses it from the header
    (TooManyPixels) at once: nothing is decoded (a time bound here; the caller bounds the peak RSS of the whole run)."""
    import time

    import amplify

    if counter is not None:
        counter[0] += 1
    data = amplify.FORMATS[fmt](w, h)
    t = time.perf_counter()
    try:
        head = img_ops.probe_image(data, fmt)
    except img_ops.ImageError as e:  # over vlmrt's 120 MP or Pillow's own limit, or a header its format refuses
        assert str(e).strip() and time.perf_counter() - t < 1.0
        return
    assert head.size == (w, h) and head.pixels == w * h, (fmt, w, h, head)
    try:
        img_ops.decode_image(data, fmt, max_pixels=limit)
    except img_ops.TooManyPixels as e:
        assert f"{w}×{h}" in str(e)
    else:
        raise AssertionError(f"{fmt} {w}×{h} decoded under a limit of {limit} pixels")
    assert time.perf_counter() - t < 1.0, (fmt, w, h)


def amplification_property(max_examples: int, counter: list | None = None, seed: int | None = None):
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(huge_headers())
    def prop(case):
        check_amplification(*case, counter)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="vlmrt-fuzz-"))


def prompt_property(spec, tokenizer, max_examples: int, counter: list | None = None, seed: int | None = None):
    """Message text never becomes a control token: for conversations whose texts mix the tokenizer's control-token
    strings, their fragments, the sentinel character, whitespace and other text, the prompt (vlmrt's default) decodes
    to the rendered text, holds as many control tokens as the same conversation with plain texts (the template's
    own), and equals the old tokenization where no text holds a control-token string; or the conversation is refused
    for the image placeholder, with the option too."""
    from vlmrt.runtime.prompt.conversation import ChatTemplate, ConversationError, control_strings, parse_messages
    from vlmrt.runtime.prompt.build import build

    cs = control_strings(tokenizer)
    specials = {tokenizer.token_to_id(s) for s in cs}
    literal, allowed = ChatTemplate(spec, cs), ChatTemplate(spec)
    atoms = st.sampled_from(cs + ["<", ">", "|", "<|", "|>", "_", "im", "row", "\ue000", "0", " ", "\n", "a", "é",
                                  "\U0001f642", "assistant", "User:"])
    text = st.lists(st.one_of(atoms, st.text(max_size=4)), max_size=12).map("".join)
    turns = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), text), min_size=1, max_size=3)

    def ids(template, messages) -> list[int]:
        return build(template.render(parse_messages(messages)), [], spec, tokenizer, -1).ids

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(turns, text)
    def prop(history, last):
        if counter is not None:
            counter[0] += 1
        messages = [{"role": r, "content": t} for r, t in history] + [{"role": "user", "content": last}]
        try:
            rendered = "".join(allowed.render(parse_messages(messages)))
        except ConversationError as e:
            assert "must not contain" in str(e)
            try:
                literal.render(parse_messages(messages))
            except ConversationError as e2:
                assert "must not contain" in str(e2)
                return
            raise AssertionError("the placeholder was refused only with the option")
        got = ids(literal, messages)
        assert tokenizer.decode(got, skip_special_tokens=False) == rendered
        template_only = ids(literal, [{"role": m["role"], "content": "x"} for m in messages])
        assert sum(t in specials for t in got) == sum(t in specials for t in template_only)
        if not any(s in m["content"] for s in cs for m in messages):
            assert got == ids(allowed, messages)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop


# ---------------------------------------------------------------- videos

VIDEO_CORPUS = Path(__file__).resolve().parent / "corpus" / "videos"
VIDEO_SEEDS = [p.read_bytes() for p in sorted(VIDEO_CORPUS.iterdir()) if p.stat().st_size < 10000]
# texts FFmpeg's probing would take as instructions (sockets, other files): loopback addresses and local names only
FFMPEG_SCRIPTS = [b"v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=x\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=video 5004 RTP/AVP 96\r\n",
                  b"#EXTM3U\n#EXTINF:1,\nhttp://127.0.0.1:9/a.ts\n", b"ffconcat version 1.0\nfile /etc/hostname\n",
                  b"rtsp://127.0.0.1:9/x", b"file:/etc/hostname", b"img%03d.png", b"[Script Info]\n"]


@st.composite
def mutated_video(draw) -> bytes:
    return _mutated(draw, VIDEO_SEEDS)


video_inputs = st.one_of(st.binary(max_size=300), mutated_video(), mutated_video(), mutated_video(),
                         st.sampled_from(FFMPEG_SCRIPTS), st.builds(lambda a, b: a + b, st.sampled_from(FFMPEG_SCRIPTS),
                                                                     st.binary(max_size=40)))


def check_video(data: bytes, counter: list | None = None) -> None:
    """read_video on data, then every frame it says it has: a clip whose frames decode, or VideoError; FFmpeg opened
    only with a demuxer of PYAV_FORMATS, and every container closed again."""
    import av
    import numpy as np

    from vlmrt.runtime.media import video as V

    if counter is not None:
        counter[0] += 1
    opened, real = [], av.open

    def record(file, *a, **kw):
        assert kw.get("format") in V.PYAV_FORMATS, f"FFmpeg asked to open {kw.get('format')!r}"
        c = real(file, *a, **kw)
        opened.append(c)
        return c

    av.open = record
    try:
        clip = V.read_video(None, data=data, label="fuzz")
        frames = clip.frames(np.arange(min(clip.total_frames, 16)))
        assert all(f.mode == "RGB" and f.width * f.height <= V.MAX_FRAME_PIXELS for f in frames)
    except V.VideoError as e:
        assert str(e).strip()
    finally:
        av.open = real
    assert all(not c.input_was_opened for c in opened), "a container left open"


def video_property(max_examples: int, counter: list | None = None, seed: int | None = None):
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(video_inputs)
    def prop(data):
        check_video(data, counter)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop


# ---------------------------------------------------------------- media-folder paths (vlmrt serve --media-dir)

def hostile_media(root: Path) -> Path:
    """A media folder with a symbolic link loop inside, a link into a loop outside, a dangling link, a file used as a
    folder, a FIFO, a link to a device, a link out of the folder, a folder and one real file."""
    import os

    media = root / "media"
    media.mkdir()
    (media / "loop1").symlink_to("loop2")
    (media / "loop2").symlink_to("loop1")
    (root / "out_a").symlink_to(root / "out_b")
    (root / "out_b").symlink_to(root / "out_a")
    (root / "secret").write_bytes(b"outside")
    (media / "to_outer_loop").symlink_to(root / "out_a")
    (media / "to_secret").symlink_to(root / "secret")
    (media / "dangling").symlink_to("nowhere")
    (media / "afile").write_bytes(b"inside")
    os.mkfifo(media / "fifo")
    (media / "zero").symlink_to("/dev/zero")
    (media / "sub").mkdir()
    return media


MEDIA_PARTS = ["..", ".", "", "loop1", "loop2", "to_outer_loop", "to_secret", "dangling", "afile", "fifo", "zero", "sub",
               "x" * 300, "\x00", "nowhere", "%2e%2e", "secret", "/", "//", "~", "\\..\\", "\x1f\U0001342f" * 40]


def media_paths():
    parts = st.one_of(st.sampled_from(MEDIA_PARTS), st.text(max_size=12))
    return st.one_of(st.lists(parts, min_size=1, max_size=30).map("/".join), st.text(max_size=300),
                     st.sampled_from(PATHISH), st.integers(1, 6000).map(lambda n: "a/" * (n // 2)))


def check_media_path(media: Path, url: str, counter: list | None = None) -> None:
    """The server's media-folder read: the bytes of a regular file inside the folder, or one 400 whose message quotes
    at most the start of url, never the folder's own path."""
    from vlmrt.serve.errors import APIError
    from vlmrt.serve.media import _read_local

    if counter is not None:
        counter[0] += 1
    try:
        data = _read_local(url, media, "image", 1 << 20)
    except APIError as e:
        assert e.status == 400 and e.code == "invalid_image" and e.message.strip()
        assert str(media.parent) not in e.message and len(e.message) < 300, e.message
        return
    assert data == b"inside", (url, data)  # the one regular file inside the folder


def media_path_property(media: Path, max_examples: int, counter: list | None = None, seed: int | None = None):
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None and counter is None,
              suppress_health_check=list(HealthCheck))
    @given(media_paths())
    def prop(url):
        check_media_path(media, url, counter)

    if seed is not None:
        from hypothesis import seed as with_seed

        prop = with_seed(seed)(prop)
    return prop
