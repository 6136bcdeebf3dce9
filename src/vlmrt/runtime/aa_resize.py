"""The antialiased uint8 resize of torchvision's tensor transforms (what transformers' SmolVLMVideoProcessor resizes
frames with), in numpy: separable passes, horizontal then vertical, each with int16 fixed-point weights and a
rounding shift to uint8 (ATen's CPU uint8 kernels, themselves a port of Pillow-SIMD's). Pillow's own resize uses
22-bit weights and differs from it by a level or more here and there, so video frames are resized with this one
to equal the reference pixel for pixel.

    out = resize(rgb_uint8_hwc, height, width, "lanczos")
"""

from __future__ import annotations

import numpy as np


def _lanczos(x: np.ndarray) -> np.ndarray:
    return np.where((x >= -3.0) & (x < 3.0), np.sinc(x) * np.sinc(x / 3), 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:  # a = -0.5, as the antialiased kernels
    a, x = -0.5, np.abs(x)
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _bilinear(x: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, 1.0 - np.abs(x))


FILTERS = {"lanczos": (_lanczos, 3.0), "bicubic": (_bicubic, 2.0), "bilinear": (_bilinear, 1.0)}


def weights(in_size: int, out_size: int, name: str) -> tuple[np.ndarray, int]:
    """[out, in] int64 fixed-point weights and their precision (bits) for one axis."""
    filt, half = FILTERS[name]
    scale = in_size / out_size
    support = half * scale if scale >= 1.0 else half
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    w = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        row = filt((np.arange(hi - lo) + lo - center + 0.5) * inv)
        total = row.sum()
        w[i, lo:hi] = row / total if total != 0 else row
    top = w.max()
    bits = 0
    for bits in range(22):  # the most bits that keep the largest weight within int16
        if int(0.5 + top * (1 << (bits + 1))) >= (1 << 15):
            break
    v = w * (1 << bits)
    return np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int64), bits


def resize(x: np.ndarray, height: int, width: int, name: str = "lanczos") -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8."""
    if name not in FILTERS:
        raise ValueError(f"no antialiased uint8 resize for the {name!r} filter (lanczos, bicubic, bilinear)")
    h0, w0, _ = x.shape
    y = x.astype(np.int64)
    if width != w0:
        m, bits = weights(w0, width, name)
        y = np.clip((np.einsum("ow,hwc->hoc", m, y) + (1 << (bits - 1))) >> bits, 0, 255)
    if height != h0:
        m, bits = weights(h0, height, name)
        y = np.clip((np.einsum("oh,hwc->owc", m, y) + (1 << (bits - 1))) >> bits, 0, 255)
    return y.astype(np.uint8)
