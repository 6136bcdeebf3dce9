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


def _taps(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An axis's [out, in] weights as (indices [out, k], weights [out, k]): each output's band of taps (k = the widest
    band; taps past an output's own band have weight 0), so a pass costs out × k, not out × in."""
    nz = m != 0
    lo = np.where(nz.any(1), nz.argmax(1), 0)
    hi = np.where(nz.any(1), m.shape[1] - nz[:, ::-1].argmax(1), 1)
    k = int((hi - lo).max())
    idx = lo[:, None] + np.arange(k)[None, :]
    inside = idx < hi[:, None]
    idx = np.where(inside, idx, lo[:, None])
    return idx, np.where(inside, np.take_along_axis(m, idx, 1), 0)


def _pass_rows(x: np.ndarray, m: np.ndarray, bits: int) -> np.ndarray:
    """Resample axis 0 of x [n, w, c] uint8 with weights m [out, n] (int64 accumulators: lanczos / bicubic weights
    are negative in places; >> is an arithmetic shift, as the kernel's)."""
    idx, w = _taps(m)
    acc = np.full((m.shape[0],) + x.shape[1:], 1 << (bits - 1), np.int64)
    for t in range(idx.shape[1]):
        acc += x[idx[:, t]] * w[:, t, None, None]
    return np.clip(acc >> bits, 0, 255).astype(np.uint8)


def resize(x: np.ndarray, height: int, width: int, name: str = "lanczos") -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8."""
    if name not in FILTERS:
        raise ValueError(f"no antialiased uint8 resize for the {name!r} filter (lanczos, bicubic, bilinear)")
    h0, w0, _ = x.shape
    y = np.asarray(x, np.uint8)
    if width != w0:  # the horizontal pass, on the image transposed so that a tap reads whole rows
        m, bits = weights(w0, width, name)
        y = _pass_rows(np.ascontiguousarray(y.transpose(1, 0, 2)), m, bits).transpose(1, 0, 2)
    if height != h0:
        m, bits = weights(h0, height, name)
        y = _pass_rows(y, m, bits)
    return np.ascontiguousarray(y)
