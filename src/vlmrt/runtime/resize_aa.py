"""Antialiased bilinear resize of uint8 images with torch's integer arithmetic, in numpy.

transformers' torchvision image processors (LFM2-VL's `Lfm2VlImageProcessor`) resize uint8 tensors with
`torchvision.transforms.v2.functional.resize(antialias=True)`, which on x86-64 CPUs with AVX2 / AVX-512 and on
aarch64 runs torch's native uint8 kernel (ATen `UpSampleKernel.cpp`, "Weights computation for uint8_t and
multiplication trick"; after Pillow-SIMD). Pillow's own BILINEAR filter is the same triangle filter but rounds
differently (22-bit int32 coefficients instead of int16 ones): one level apart on up to a quarter of the pixels. This
module is that kernel's arithmetic, exactly:

* per axis, per output index i: center = scale * (i + 0.5), scale = in / out, support = max(scale, 1); taps
  xmin = max(int(center - support + 0.5), 0) .. min(int(center + support + 0.5), in); weight of tap j the triangle
  max(0, 1 - |(j - center + 0.5) / max(scale, 1)|), normalized to sum 1 (float64);
* the weights become int16: precision p = the largest p < 22 with int(0.5 + w_max * 2^(p+1)) < 2^15 (w_max over
  the whole axis), w_int = int(0.5 + w * 2^p);
* a pass sums pixel * w_int in integers, adds 2^(p-1), shifts right by p and saturates to 0..255;
* the horizontal pass first (when the width changes), its uint8 result fed to the vertical pass (when the height
  changes); an axis whose size does not change is not touched.
"""

from __future__ import annotations

import numpy as np


def axis_taps(size_in: int, size_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(indices [out, k] int64, int16-range weights [out, k] int64, precision) of one axis; taps past an output's own
    range have weight 0 (their index clamped into the axis)."""
    scale = size_in / size_out
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    k = int(np.ceil(support)) * 2 + 1
    idx = np.zeros((size_out, k), np.int64)
    w = np.zeros((size_out, k), np.float64)
    for i in range(size_out):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)  # int(): truncation toward zero, as the C++ cast
        xsize = min(int(center + support + 0.5), size_in) - xmin
        j = np.arange(xsize)
        row = np.clip(1.0 - np.abs((j + xmin - center + 0.5) * invscale), 0.0, None)
        total = 0.0
        for v in row:  # summed in order, as the kernel does (float64)
            total += v
        if total != 0.0:
            row = row / total
        w[i, :xsize] = row
        idx[i, :xsize] = xmin + j
        idx[i, xsize:] = min(xmin, size_in - 1)
    w_max = w.max()
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    return idx, (0.5 + w * (1 << precision)).astype(np.int64), precision


def _pass_rows(x: np.ndarray, size_out: int) -> np.ndarray:
    """Resample axis 0 of x [n, ...] uint8 to size_out. int32 accumulators as the kernel's: the sum is at most
    255 * 2^precision * (1 + rounding) + 2^(precision-1) < 2^31 for precision <= 22."""
    idx, w, precision = axis_taps(x.shape[0], size_out)
    w = w.astype(np.int32).reshape((size_out, -1) + (1,) * (x.ndim - 1))
    acc = np.full((size_out,) + x.shape[1:], 1 << (precision - 1), np.int32)
    for t in range(idx.shape[1]):
        acc += x[idx[:, t]] * w[:, t]  # uint8 * int32 -> int32
    np.right_shift(acc, precision, out=acc)
    return np.clip(acc, 0, 255).astype(np.uint8)


def resize_bilinear_aa(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8, as torch's antialiased bilinear uint8 kernel computes it."""
    if x.dtype != np.uint8 or x.ndim != 3:
        raise ValueError(f"resize_bilinear_aa takes [H, W, C] uint8, not {x.dtype} {x.shape}")
    if height < 1 or width < 1:
        raise ValueError(f"cannot resize to {height}×{width}")
    if x.shape[1] != width:  # the horizontal pass, on the image transposed so that a tap reads whole rows
        x = _pass_rows(np.ascontiguousarray(x.transpose(1, 0, 2)), width).transpose(1, 0, 2)
    if x.shape[0] != height:
        x = _pass_rows(x, height)
    return np.ascontiguousarray(x)
