"""The token table's stored forms (`vlmrt export --table`): rows quantized at export, dequantized on the host per
row read (numpy; static/table.js gives the same float32 rows bit for bit).

  float32 / float16   the rows as they are
  int8                symmetric int8, one float32 scale per row ([vocab] embed_scale.npy): row = q · s
  int8gG / int4gG     symmetric int8 / 4-bit, one float16 scale per G values of a row ([vocab, ⌈width / G⌉]
                      embed_scale.npy, read per row as the codes are; the last group shorter where G does not
                      divide the width); 4-bit codes two per byte (code + 8, a row's even column in the low nibble;
                      an odd width's last high nibble 8), so a row is ⌈width / 2⌉ bytes

A value is q · s computed in float32 (q an integer of at most 8 bits, s the float32 of the stored scale: the
product is exact before its one rounding, which JavaScript's Math.fround(q * s) gives too).
"""

from __future__ import annotations

import numpy as np

# name -> (bits, values per scale; 0: one scale per row). The float forms store no codes.
FORMS = {"float32": (32, 0), "float16": (16, 0), "int8": (8, 0), "int8g64": (8, 64), "int4g32": (4, 32),
         "int4g64": (4, 64)}
LEVELS = {8: 127, 4: 7}
CODE_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "int4": np.uint8}  # embed.npy's dtype


class TableFormError(ValueError):
    pass


def check_form(name: str) -> str:
    if name not in FORMS:
        raise TableFormError(f"unknown token table form {name!r}; choose one of {', '.join(FORMS)}")
    return name


def manifest_of(name: str) -> tuple[str, int | None]:
    """(decoder.embedding_dtype, decoder.embedding_group) of a form."""
    bits, group = FORMS[check_form(name)]
    if bits > 8:
        return name, None
    return f"int{bits}", group or None


def form_of(dtype: str, group: int | None) -> str:
    """The form a manifest's (embedding_dtype, embedding_group) names."""
    name = dtype if not group else f"{dtype}g{group}"
    return check_form(name)


def code_width(name: str, width: int) -> int:
    """Columns of embed.npy for rows `width` values wide."""
    return (width + 1) // 2 if FORMS[name][0] == 4 else width


def scale_width(name: str, width: int) -> int:
    """Scales per row of a grouped form: a group of G values, the last one shorter where G does not divide width."""
    return -(-width // FORMS[name][1])


def quantize(rows: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 rows [n, width] -> (codes as embed.npy stores them, scales or None)."""
    bits, group = FORMS[check_form(name)]
    rows = np.asarray(rows, np.float32)
    if bits > 8:
        return rows.astype(CODE_DTYPES[name]), None
    levels = LEVELS[bits]
    n, width = rows.shape
    if not group:  # float32 scale per row (the other families' int8 table, byte for byte)
        amax = np.abs(rows).max(axis=1)
        scale = np.where(amax > 0, amax / np.float32(levels), 1.0).astype(np.float32)
        q = np.clip(np.rint(rows / scale[:, None]), -levels, levels).astype(np.int8)
        return q, scale
    groups = scale_width(name, width)
    x = np.zeros((n, groups * group), np.float32)
    x[:, :width] = rows
    x = x.reshape(n, groups, group)
    amax = np.abs(x).max(axis=2)
    scale16 = np.minimum(amax / np.float32(levels), np.float32(65504)).astype(np.float16)
    s = scale16.astype(np.float32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(x / s), 0)
    q = np.clip(q, -levels, levels).astype(np.int8).reshape(n, -1)[:, :width]
    if bits == 4:
        u = np.full((n, 2 * code_width(name, width)), 8, np.uint8)
        u[:, :width] = q + 8
        q = u[:, 0::2] | (u[:, 1::2] << 4)
    return q, scale16


def dequantize(codes: np.ndarray, scales: np.ndarray | None, name: str, width: int) -> np.ndarray:
    """(codes, scales) as quantize gives them (or rows read from the files) -> float32 rows [n, width]."""
    bits, group = FORMS[check_form(name)]
    if bits > 8:
        return np.asarray(codes, np.float32)
    if not group:
        return codes.astype(np.float32) * np.asarray(scales, np.float32)[:, None]
    n, groups = codes.shape[0], scale_width(name, width)
    q = np.zeros((n, groups * group), np.float32)
    if bits == 4:
        q[:, 0:width:2] = (codes[:, :(width + 1) // 2] & 15).astype(np.float32) - 8
        q[:, 1:width:2] = (codes[:, :width // 2] >> 4).astype(np.float32) - 8
    else:
        q[:, :width] = codes
    s = np.asarray(scales).astype(np.float32)
    return (q.reshape(n, groups, group) * s[:, :, None]).reshape(n, -1)[:, :width]


class GroupRows:
    """A grouped table read per row: the codes' rows and their scales' rows (each an EmbeddingRows: pread), float32
    rows [n, width] out; TokenEmbedding takes it as a float table."""

    def __init__(self, codes, scales, name: str, width: int):
        self.codes, self.scales, self.name = codes, scales, name
        self.shape, self.dtype = (codes.shape[0], width), np.dtype(np.float32)

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return dequantize(self.codes[ids], self.scales[ids], self.name, self.shape[1])

    def row(self, token: int) -> np.ndarray:
        """Token's row [width] (0 <= token < vocab, unchecked here)."""
        return dequantize(self.codes.row(token)[None], self.scales.row(token)[None], self.name, self.shape[1])[0]
