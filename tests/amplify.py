"""Decompression amplification: small files whose headers declare huge images, in every format Pillow reads that the
server may be sent (tests/test_serve_security.py, test_bad_input_corpus.py, fuzz_targets.py). Each is built here
byte by byte (nothing of its size is ever allocated by the test): a PNG that really decodes (1-bit, zlib: a
10900 × 10900 one is ~15 KB), and GIF, BMP (RLE8), TIFF (PackBits), WebP (VP8L), JPEG headers followed by a few bytes
of image data (a decoder given them would allocate the whole image before finding the data short)."""

from __future__ import annotations

import struct
import zlib


def png(w: int, h: int) -> bytes:
    """A valid 1-bit grayscale PNG of w × h black pixels (zlib at ~1000:1)."""
    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    row, z, parts = bytes(1 + (w + 7) // 8), zlib.compressobj(9), []
    parts = [z.compress(row) for _ in range(h)]
    data = b"".join(parts) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)) + chunk(b"IDAT", data)
            + chunk(b"IEND", b""))


def gif(w: int, h: int) -> bytes:
    """GIF89a: a w × h logical screen and one w × h frame (2-color table), a few bytes of LZW data."""
    return (b"GIF89a" + struct.pack("<HHBBB", w, h, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
            + b"\x2c" + struct.pack("<HHHHB", 0, 0, w, h, 0) + b"\x02\x02\x4c\x01\x00\x3b")


def bmp(w: int, h: int) -> bytes:
    """A BMP (BITMAPINFOHEADER, 8-bit RLE8, 2-color palette): its RLE data ends the bitmap at once."""
    palette = b"\0\0\0\0\xff\xff\xff\0"
    data = b"\x00\x01"  # RLE8 end of bitmap
    offset = 14 + 40 + len(palette)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 8, 1, len(data), 2835, 2835, 2, 0)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + palette + data


def tiff(w: int, h: int) -> bytes:
    """A little-endian TIFF, 1-bit black-is-zero, PackBits, one strip of a few bytes."""
    data = b"\x81\x00" * 4
    tags = [(256, 4, w), (257, 4, h), (258, 3, 1), (259, 3, 32773), (262, 3, 1), (273, 4, 0), (277, 3, 1),
            (278, 4, h), (279, 4, len(data))]
    ifd_at = 8
    data_at = ifd_at + 2 + 12 * len(tags) + 4
    entries = b"".join(struct.pack("<HHII", tag, kind, 1, data_at if tag == 273 else value) if kind == 4 else
                       struct.pack("<HHIHH", tag, kind, 1, value, 0) for tag, kind, value in tags)
    return b"II*\0" + struct.pack("<I", ifd_at) + struct.pack("<H", len(tags)) + entries + b"\0\0\0\0" + data


def webp(w: int, h: int) -> bytes:
    """A lossless WebP (VP8L) of w × h (at most 16384 a side): a 16 × 16 one's 14-byte bitstream, its size changed."""
    payload = b"\x2f" + struct.pack("<I", (w - 1) | (h - 1) << 14) + b"\x07\x10\x11\xfd\x0fDD\xff\x03"
    chunk = b"VP8L" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def jpeg(w: int, h: int) -> bytes:
    """A baseline JPEG header (one gray component, a quantization and a Huffman table) of w × h, a few scan bytes."""
    dqt = b"\xff\xdb" + struct.pack(">H", 67) + b"\x00" + bytes([1] * 64)
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    dht = b"\xff\xc4" + struct.pack(">H", 20) + b"\x00" + bytes([1] + [0] * 15) + b"\x00"
    sos = b"\xff\xda" + struct.pack(">HB", 8, 1) + b"\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + dqt + sof + dht + sos + b"\x00" * 16 + b"\xff\xd9"


FORMATS = {"png": png, "gif": gif, "bmp": bmp, "tiff": tiff, "webp": webp, "jpeg": jpeg}


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def peak_growth_mb(fn) -> tuple[object, float]:
    """fn()'s result and how far this process's peak RSS rose above its RSS at the start, in MB (Linux: the peak is
    reset first through /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _status_mb("VmRSS")
    out = fn()
    return out, _status_mb("VmHWM") - start
