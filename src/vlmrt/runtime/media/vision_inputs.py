"""What a native-resolution vision graph takes besides its patches, computed on the host from the image's grid
(numpy only): everything in Qwen2.5-VL's and Qwen3-VL's vision towers that depends on the grid, so that one static
graph padded to the patch budget serves every image size.

  rotary_2d               cos / sin [patches, head_dim] of the ViT's 2-D rotary embedding: (row, column) of each
                          patch in merge-block order, frequencies over head_dim / 2 for each axis, laid out
                          [h, w, h, w] (transformers' Qwen2_5_VLVisionRotaryEmbedding / Qwen3VLVisionRotaryEmbedding)
  window_order            Qwen2.5-VL's window attention: the order the tower sees the merge blocks in (windows of
                          window_size px, row-major, each row-major inside) and each patch's window id
                          (transformers' vision_utils.get_vision_window_index)
  interpolated_positions  Qwen3-VL's learned position table, bilinear with aligned corners from its side² grid to the
                          image's: four table rows and four weights per patch (get_vision_interpolation_indices_and_weights)
  segment_mask            an additive attention mask [rows, rows] from one segment id per row: a row sees the rows of
                          its own segment; padding rows are their own segment, so no real row sees them and no row is
                          left with nothing to attend to

The graph's padding rows (after the image's patches, up to the budget) are zero patches whose results the host drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def merge_block_positions(grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch, patches in merge-block order (the processor's): [grid_h * grid_w] each."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    shape = (grid_h // merge, merge, grid_w // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1), cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)


def rotary_2d(grid_h: int, grid_w: int, merge: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [grid_h * grid_w, head_dim] float32 of the ViT's axial rotary embedding (merge-block order)."""
    half = head_dim // 2  # each axis rotates over half of head_dim: head_dim / 4 frequencies
    inv_freq = (1.0 / theta ** (np.arange(0, half, 2, dtype=np.float64) / half)).astype(np.float32)
    rows, cols = merge_block_positions(grid_h, grid_w, merge)
    freqs = np.concatenate([rows[:, None].astype(np.float32) * inv_freq, cols[:, None].astype(np.float32) * inv_freq],
                           axis=1)  # [n, head_dim / 2] float32, as transformers multiplies
    angles = np.concatenate([freqs, freqs], axis=1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def window_order(grid_h: int, grid_w: int, merge: int, window: int, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window attention for one image: (block_order [blocks]: the merge blocks in the order the tower
    sees them, window_ids [blocks]: the window of each block in that order). The tower's patches are permuted block
    by block (patch rows block_order[i]*merge² .. +merge²) and its output tokens put back with argsort(block_order)."""
    side = window // merge // patch  # merge blocks per window side
    bh, bw = grid_h // merge, grid_w // merge
    # padded up to whole windows (a full extra window when a side divides evenly, as transformers pads: it is empty)
    ph, pw = bh + side - bh % side, bw + side - bw % side
    index = np.full((ph, pw), -1, np.int64)
    index[:bh, :bw] = np.arange(bh * bw).reshape(bh, bw)
    wins = index.reshape(ph // side, side, pw // side, side).transpose(0, 2, 1, 3).reshape(-1, side * side)
    win_of = np.broadcast_to(np.arange(len(wins))[:, None], wins.shape)
    keep = wins >= 0
    return wins[keep], win_of[keep].astype(np.int64)


def interpolated_positions(grid_h: int, grid_w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL: (indices [n, 4] int64 into the side² position table, weights [n, 4] float32), patches in merge-block
    order; bilinear with aligned corners (the table's corners land on the grid's), computed in float32 as
    transformers does."""
    rows, cols = merge_block_positions(grid_h, grid_w, merge)

    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
        return taps, np.clip(np.float32(1) - distance, 0, None).astype(np.float32)

    h_taps, h_w = axis(rows, grid_h)
    w_taps, w_w = axis(cols, grid_w)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return indices, weights


def segment_mask(segments: np.ndarray, value: float) -> np.ndarray:
    """[rows] segment ids -> additive mask [rows, rows] float32: 0 where both rows are in one segment, else value."""
    return np.where(segments[:, None] == segments[None, :], np.float32(0), np.float32(value)).astype(np.float32)


def padded_segments(real: np.ndarray, rows: int) -> np.ndarray:
    """Segment ids for a graph of `rows`: the real rows' ids, then -1 (the padding's own segment)."""
    out = np.full(rows, -1, np.int64)
    out[: len(real)] = real
    return out


OPS = ("rotary_2d", "window_order", "interpolated_positions")  # the names a manifest's vision.host_inputs may list


@dataclass
class VisionFeeds:
    feeds: dict[str, np.ndarray]  # graph input name -> array, padded to the graph's rows
    tokens: int  # the image's tokens: the first `tokens` rows of each output are real
    token_order: np.ndarray | None  # window_order: output row i is the image's token token_order[i] (None: in order)

    def restore(self, out: np.ndarray) -> np.ndarray:
        """An output [rows / merge², dim] -> the image's tokens [tokens, dim] in raster merge-block order."""
        out = out[: self.tokens]
        if self.token_order is None:
            return out
        back = np.empty_like(out)
        back[self.token_order] = out
        return back


def build_feeds(patches: np.ndarray, grid: tuple[int, int, int], ops: list[str], params: dict, rows: int,
                mask_value: float) -> VisionFeeds:
    """The vision graph's inputs for one image's patches [n, patch_dim] (merge-block order) with grid (t, h, w), for
    a graph of `rows` patch rows. ops: the host inputs the graph takes (OPS); params: head_dim, theta, merge, and
    window + patch (window_order) or position_side (interpolated_positions). Inputs: `patches`, `rotary_cos`,
    `rotary_sin`, then `full_mask` + `window_mask` (window_order) or `attention_mask`, and `pos_index` + `pos_weight`
    (interpolated_positions)."""
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"this vlmrt has no vision input op {unknown[0]!r}; upgrade vlmrt")
    _, gh, gw = grid
    merge = int(params["merge"])
    unit, n = merge * merge, len(patches)
    if n > rows or n % unit or n != gh * gw:
        raise ValueError(f"{n} patches of a {gh}x{gw} grid do not fit a vision graph of {rows} rows")
    feeds: dict[str, np.ndarray] = {}
    cos, sin = rotary_2d(gh, gw, merge, int(params["head_dim"]), float(params["theta"]))
    index = pos_weight = None
    if "interpolated_positions" in ops:
        index, pos_weight = interpolated_positions(gh, gw, merge, int(params["position_side"]))
    order = None
    full = np.zeros(n, np.int64)  # one image: one segment
    if "window_order" in ops:
        order, wins = window_order(gh, gw, merge, int(params["window"]), int(params["patch"]))
        rows_of = (order[:, None] * unit + np.arange(unit)).reshape(-1)  # the patch rows of each block, in order
        patches, cos, sin = patches[rows_of], cos[rows_of], sin[rows_of]
        feeds["full_mask"] = segment_mask(padded_segments(full, rows), mask_value)
        feeds["window_mask"] = segment_mask(padded_segments(np.repeat(wins, unit), rows), mask_value)
    else:
        feeds["attention_mask"] = segment_mask(padded_segments(full, rows), mask_value)
    pad = rows - n
    feeds["patches"] = np.pad(patches, ((0, pad), (0, 0)))
    feeds["rotary_cos"] = np.pad(cos, ((0, pad), (0, 0)), constant_values=1)
    feeds["rotary_sin"] = np.pad(sin, ((0, pad), (0, 0)))
    if index is not None:
        feeds["pos_index"] = np.pad(index, ((0, pad), (0, 0)))
        feeds["pos_weight"] = np.pad(pos_weight, ((0, pad), (0, 0)))
    return VisionFeeds(feeds, n // unit, order)

