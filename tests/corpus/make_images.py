"""Writes the image half of the bad-input corpus (tests/corpus/images/) and its expected outcomes
(tests/corpus/images.json). Run once and commit the output; test_bad_input_corpus.py reads the files, never this.

    .venv/bin/python tests/corpus/make_images.py
"""

from __future__ import annotations

import io
import json
import zlib
import struct
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "images"


def asym(w: int = 40, h: int = 20) -> Image.Image:
    """An image whose every orientation differs: a gradient plus a marked corner."""
    x = np.zeros((h, w, 3), np.uint8)
    x[..., 0] = np.linspace(0, 255, w)[None, :]
    x[..., 1] = np.linspace(0, 255, h)[:, None]
    x[: h // 4, : w // 4] = (255, 255, 255)
    return Image.fromarray(x, "RGB")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bilevel_png(w: int, h: int) -> bytes:
    """A 1-bit all-black PNG of w×h written row by row (a few kB on disk, w*h pixels once decoded)."""
    row = b"\0" + b"\0" * ((w + 7) // 8)
    comp = zlib.compressobj(9)
    data = b"".join(comp.compress(row) for _ in range(h)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    cases = {}

    def save(name: str, data: bytes, expect: str, size=None, note: str = ""):
        (OUT / name).write_bytes(data)
        cases[name] = {"expect": expect, **({"size": list(size)} if size else {}), "note": note}

    def encode(im: Image.Image, fmt: str, **kw) -> bytes:
        b = io.BytesIO()
        im.save(b, fmt, **kw)
        return b.getvalue()

    jpg = encode(asym(), "JPEG", quality=90)
    save("empty.jpg", b"", "cannot read image", note="0 bytes")
    save("truncated.jpg", jpg[: len(jpg) // 2], "cannot read image", note="first half of a JPEG")
    save("text.jpg", b"this is a text file, renamed .jpg\n", "cannot read image")
    save("png_header_only.png", b"\x89PNG\r\n\x1a\n", "cannot read image")
    save("bomb_400mp.png", bilevel_png(20000, 20000), "too large to decode safely",
         note="20000x20000 1-bit PNG: over Pillow's own 179 MP bomb limit, refused by Image.open")
    save("big_121mp.png", bilevel_png(11000, 11000), "million pixels",
         note="11000x11000: under Pillow's limit, over vlmrt's MAX_IMAGE_PIXELS (120 MP), refused from the header")
    save("one_pixel.png", encode(Image.new("RGB", (1, 1), (200, 10, 10)), "PNG"), "ok", (1, 1))
    save("sliver_4000x3.png", encode(Image.new("RGB", (4000, 3), (10, 200, 10)), "PNG"), "ok", (4000, 3))
    g16 = Image.fromarray(np.arange(64 * 32, dtype=np.uint16).reshape(32, 64) * 31)  # mode I;16
    save("gray16.png", encode(g16, "PNG"), "ok", (64, 32), note="16-bit grayscale")
    save("cmyk.jpg", encode(asym().convert("CMYK"), "JPEG", quality=90), "ok", (40, 20))
    pal = asym().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    save("palette.png", encode(pal, "PNG"), "ok", (40, 20))
    save("palette_transparent.png", encode(pal, "PNG", transparency=0), "ok", (40, 20), note="tRNS: composited on white")
    frames = [Image.new("RGB", (30, 20), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    save("animated.gif", encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0),
         "ok", (30, 20), note="first frame used")
    rgba = Image.fromarray(np.dstack([np.asarray(asym()), np.tile(np.linspace(0, 255, 40, dtype=np.uint8), (20, 1))]), "RGBA")
    save("rgba.png", encode(rgba, "PNG"), "ok", (40, 20), note="alpha composited on white")
    save("la.png", encode(asym().convert("LA"), "PNG"), "ok", (40, 20))
    for o in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = o  # Orientation
        size = (40, 20) if o <= 4 else (20, 40)  # 5-8 swap width and height
        save(f"exif_orientation_{o}.jpg", encode(asym(), "JPEG", quality=95, exif=exif.tobytes()), "ok", size,
             note="EXIF orientation applied (ImageOps.exif_transpose, as transformers' load_image)")
    (HERE / "images.json").write_text(json.dumps(cases, indent=1) + "\n")


if __name__ == "__main__":
    main()
