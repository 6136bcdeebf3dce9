"""NaFlex vision inputs (LFM2-VL's SigLIP2): what the host feeds the one static vision graph for a tile of any size.

A NaFlex tile is h × w patches (runtime/media/image.py `naflex_tiles`, patch rows in raster order, padded to max_patches).
The graph is static: max_patches rows in, max_patches / f² token rows out (f = the projector's downsample factor),
and everything that depends on the tile's size comes from the host, computed here:

* the patch rows reordered token-major: token (i, j) of the (h/f) × (w/f) token grid is patches (f i + a, f j + b)
  for a, b in 0..f-1, a-major — so the projector's pixel unshuffle is a plain reshape [max_patches / f², f² · dim]
  (attention does not depend on the order of its rows; the position embeddings follow the same order);
* position weights [max_patches, side²]: the learned side × side position table resized to the h × w grid is
  weights @ table, the weights of transformers' Siglip2VisionEmbeddings.resize_positional_embeddings (bilinear,
  align_corners=False, antialiased), in its float32 arithmetic;
* an additive key mask [max_patches]: 0 for the tile's patches, mask_value for the padding rows.

The first (h/f) · (w/f) output rows are the tile's image tokens, in raster order of the token grid.
"""

from __future__ import annotations

import numpy as np


def token_order(h: int, w: int, factor: int) -> np.ndarray:
    """[h*w] raster patch indices, token-major (token grid raster, then the f×f block a-major)."""
    if h % factor or w % factor:
        raise ValueError(f"a {h}×{w} patch grid is not a multiple of the downsample factor {factor}")
    i, j, a, b = np.meshgrid(np.arange(h // factor), np.arange(w // factor), np.arange(factor), np.arange(factor),
                             indexing="ij")
    return ((factor * i + a) * w + (factor * j + b)).reshape(-1)


def _axis_weights(index: np.ndarray, size: int, side: int) -> np.ndarray:
    """[n, side] float32 interpolation weights of output coordinates index along an axis of `size` outputs."""
    scale = np.float32(side) / np.float32(size)
    support = max(scale, np.float32(1.0))
    center = (index.astype(np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    source = np.arange(side, dtype=np.float32)
    wts = np.clip(np.float32(1.0) - np.abs(source[None, :] - center[:, None]) / support, np.float32(0.0), None)
    return wts / wts.sum(-1, keepdims=True)


def position_weights(h: int, w: int, side: int) -> np.ndarray:
    """[h*w, side*side] float32: row r of an h × w grid (raster) as a weighting of the side × side table's rows."""
    n = np.arange(h * w)
    rows, cols = n // w, n % w
    wr, wc = _axis_weights(rows, h, side), _axis_weights(cols, w, side)
    return (wr[:, :, None] * wc[:, None, :]).reshape(h * w, side * side)


def tile_inputs(patches: np.ndarray, grid, side: int, factor: int, mask_value: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One tile's graph inputs from its padded raster patch rows [max_patches, d] and patch grid (h, w):
    (patches token-major [max_patches, d], position weights [max_patches, side²], key mask [max_patches], tokens)."""
    h, w = int(grid[0]), int(grid[1])
    n, max_patches = h * w, patches.shape[0]
    if n > max_patches or max_patches % (factor * factor):
        raise ValueError(f"a {h}×{w} tile does not fit {max_patches} patch rows")
    order = token_order(h, w, factor)
    x = np.zeros_like(patches)
    x[:n] = patches[order]
    pw = np.zeros((max_patches, side * side), np.float32)
    pw[:n] = position_weights(h, w, side)[order]
    mask = np.full(max_patches, mask_value, np.float32)
    mask[:n] = 0.0
    return x, pw, mask, n // (factor * factor)


def tile_tokens(patch_grids: np.ndarray, factor: int) -> list[int]:
    """Each tile's image-token count: (h / f) · (w / f) of its patch grid (the processor's ceil of an even count)."""
    return [int(-(-h // factor) * -(-w // factor)) for h, w in patch_grids]
