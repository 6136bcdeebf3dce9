"""The token table's stored forms (`vlmrt export --table`): rows quantized at export, dequantized on the host per
row read (numpy; static/table.js gives the same float32 rows bit for bit).

  float32 / float16   the rows as they are
  int8                symmetric int8, one float32 scale per row ([vocab] embed_scale.npy): row = q · s
  int8gG / int4gG     symmetric int8 / 4-bit, one float16 scale per G values of a row ([vocab, ⌈width / G⌉]
                      embed_scale.npy, read per row as the codes are; the last group shorter where G does not
                      divide the width); 4-bit codes two per byte (code + 8, a row's even column in the low nibble;
                      an odd width's last high nibble 8), so a row is ⌈width / 2⌉ bytes

  E+P                 split rows (Gemma 4's: embedding columns beside per-layer columns): the first `hidden`
                      columns in E (float32 / float16), the rest in P (int8g64 / int4g32 / int4g64), each row one run
                      of bytes (embed.npy [vocab, row bytes] uint8: E's values, then P's codes, then P's float16
                      scales, little-endian), so a row is one pread; decoder.embedding_dtype "parts" with
                      decoder.embedding_parts [(columns, dtype, group)] saying so

A value is q · s computed in float32 (q an integer of at most 8 bits, s the float32 of the stored scale: the
product is exact before its one rounding, which JavaScript's Math.fround(q * s) gives too).
"""

from __future__ import annotations

import numpy as np

# name -> (bits, values per scale; 0: one scale per row). The float forms store no codes.
FORMS = {"float32": (32, 0), "float16": (16, 0), "int8": (8, 0), "int8g64": (8, 64), "int4g32": (4, 32),
         "int4g64": (4, 64)}
LEVELS = {8: 127, 4: 7}
CODE_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "int4": np.uint8,
               "parts": np.uint8}  # embed.npy's dtype
# a split form "E+P": E for the embedding columns, P for the rest (the per-layer columns)
SPLIT_FIRST = ("float32", "float16")
SPLIT_REST = tuple(name for name, (bits, group) in FORMS.items() if group)
SPLIT_FORMS = tuple(f"{e}+{r}" for e in SPLIT_FIRST for r in SPLIT_REST)


class TableFormError(ValueError):
    pass


def names() -> str:
    """The forms, as an error message lists them."""
    return f"{', '.join(FORMS)}, or a split form E+P ({', '.join(SPLIT_FORMS)})"


def check_form(name: str) -> str:
    if name not in FORMS and name not in SPLIT_FORMS:
        raise TableFormError(f"unknown token table form {name!r}; choose one of {names()}")
    return name


def split_of(name: str) -> tuple[str, str] | None:
    """A split form's (embedding form, per-layer form); None for a form of whole rows."""
    first, plus, rest = check_form(name).partition("+")
    return (first, rest) if plus else None


def manifest_of(name: str) -> tuple[str, int | None]:
    """(decoder.embedding_dtype, decoder.embedding_group) of a form ("parts", None for a split form: its parts are
    parts_of's)."""
    if split_of(name):
        return "parts", None
    bits, group = FORMS[name]
    if bits > 8:
        return name, None
    return f"int{bits}", group or None


def parts_of(name: str, hidden: int, width: int) -> list[tuple[str, int]] | None:
    """A split form's parts, (form, columns) in row order, for rows `width` wide whose first `hidden` columns are the
    embedding; None for a form of whole rows."""
    split = split_of(name)
    return [(split[0], hidden), (split[1], width - hidden)] if split else None


def form_of(dtype: str, group: int | None) -> str:
    """The whole-row form a manifest's (embedding_dtype, embedding_group) names (or a TablePart's (dtype, group))."""
    name = dtype if not group else f"{dtype}g{group}"
    if name not in FORMS:
        raise TableFormError(f"unknown token table form {name!r}; choose one of {names()}")
    return name


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


def part_bytes(name: str, width: int) -> int:
    """Bytes of a part of `width` values in a whole-row form: its codes, then its float16 scales if grouped."""
    return _code_bytes(name, width) + (2 * scale_width(name, width) if FORMS[name][1] else 0)


def _code_bytes(name: str, width: int) -> int:
    return code_width(name, width) * np.dtype(CODE_DTYPES[manifest_of(name)[0]]).itemsize


def row_bytes(parts: list[tuple[str, int]]) -> int:
    return sum(part_bytes(name, width) for name, width in parts)


def pack(rows: np.ndarray, parts: list[tuple[str, int]]) -> np.ndarray:
    """float32 rows [n, width] -> the split form's stored rows [n, row_bytes(parts)] uint8: each part's codes, then
    its scales, as bytes (little-endian)."""
    rows = np.asarray(rows, np.float32)
    out, at = [], 0
    for name, width in parts:
        codes, scales = quantize(rows[:, at:at + width], name)
        out.append(np.ascontiguousarray(codes).view(np.uint8).reshape(len(rows), -1))
        if scales is not None:
            out.append(np.ascontiguousarray(scales.astype("<f2")).view(np.uint8).reshape(len(rows), -1))
        at += width
    return np.concatenate(out, axis=1)


def unpack(data: np.ndarray, parts: list[tuple[str, int]]) -> np.ndarray:
    """The split form's stored rows [n, row_bytes(parts)] uint8 -> float32 rows [n, width]."""
    out, at = [], 0
    for name, width in parts:
        size = _code_bytes(name, width)
        codes = np.ascontiguousarray(data[:, at:at + size]).view(CODE_DTYPES[manifest_of(name)[0]])
        at += size
        scales = None
        if FORMS[name][1]:
            scales = np.ascontiguousarray(data[:, at:at + 2 * scale_width(name, width)]).view("<f2")
            at += 2 * scale_width(name, width)
        out.append(dequantize(codes, scales, name, width))
    return np.concatenate(out, axis=1)


class PartRows:
    """A split table read per row: one pread of a row's bytes (an EmbeddingRows of uint8 [vocab, row bytes]), its
    parts dequantized side by side, float32 rows [n, width] out; TokenEmbedding takes it as a float table."""

    def __init__(self, data, parts: list[tuple[str, int]]):
        self.data, self.parts = data, parts
        self.shape, self.dtype = (data.shape[0], sum(width for _, width in parts)), np.dtype(np.float32)

    def __getitem__(self, ids) -> np.ndarray:
        return unpack(self.data[np.asarray(ids, dtype=np.int64).reshape(-1)], self.parts)

    def row(self, token: int) -> np.ndarray:
        """Token's row [width] (0 <= token < vocab, unchecked here)."""
        return unpack(self.data.row(token)[None], self.parts)[0]


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
