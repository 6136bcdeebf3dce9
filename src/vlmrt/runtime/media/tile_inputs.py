"""The vision graph's inputs for one tile, and each tile's image-token count: a named host op per way a vision graph
takes a tile (manifest vision.tile_inputs, its params; the inputs after the patch rows named by vision.extra_inputs).

    op = tile_op(manifest.vision)
    feeds, n = op.feeds(pixels[t], patch_grids[t] or None, manifest)   # {role: array}, the tile's n image tokens
    op.tokens(patch_grids, tiles, manifest)                             # [tokens of each tile] (prompt expansion)

  feeds' n: the graph output rows that are the tile's image tokens, in order: a count (the first n rows) or their
  indices (native_grid: the tower sees its merge blocks in window order, the tokens are put back in raster order).

  unfold_patches  square tiles [c, S, S] unfolded into [(S/p)², c·p·p] patch rows (image.unfold_patches); every tile
                  gives prompt.tokens_per_tile tokens
  naflex_rows     a NaFlex tile's padded raster rows and patch grid (image.naflex_tiles) -> token-major rows, the
                  position table's resize weights and the key mask (runtime/media/naflex.py); a tile of h × w patches gives
                  (h/f)·(w/f) tokens, the first rows of the graph's output
  native_grid     a native-resolution image's patch rows [patches, c·t·p²] and patch grid (image.smart_resize, one
                  tile) -> the rows padded to the graph's patch budget, the 2-D rotary, Qwen2.5-VL's window order and
                  masks or Qwen3-VL's position interpolation, the attention mask (runtime/media/vision_inputs.py); an h × w
                  grid gives (h/m)·(w/m) tokens
  pooled_positions  Gemma 4's aspect-ratio patch rows, already padded to the budget (image.pooled_aspect) -> those
                  rows and each row's patch (x, y) (-1 for padding: runtime/media/image_pooled.py); an h × w grid
                  gives (h/k)·(w/k) tokens, the first rows of the graph's output
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import image_pooled, naflex
from . import vision_inputs
from .image import unfold_patches


@dataclass(frozen=True)
class TileOp:
    name: str
    feeds: Callable  # (tile pixels, patch grid or None, manifest) -> ({role: array}, image tokens of the tile)
    tokens: Callable  # (patch grids [tiles, 2] or None, tiles, manifest) -> [image tokens per tile]
    patch_shape: Callable  # manifest -> the vision graph's patch input per tile: [rows, values per row]


def _unfold(pixels, grid, m):
    return {"patches": unfold_patches(pixels, m.image.patch_size)}, m.prompt.tokens_per_tile


def _naflex(pixels, grid, m):
    p = m.vision.params
    x, pw, mask, n = naflex.tile_inputs(pixels, grid, p["position_side"], p["downsample_factor"], p["mask_value"])
    return {"patches": x, "position_weights": pw, "key_mask": mask}, n


def _native(pixels, grid, m):
    p = m.vision.params
    rows = m.graphs["vision"].input(m.vision.patches_input).shape[0]
    f = vision_inputs.build_feeds(pixels, (1, int(grid[0]), int(grid[1])), list(p["ops"]), p, rows,
                                  float(p["mask_value"]))
    order = f.token_order
    return f.feeds, f.tokens if order is None else np.argsort(order)


def _native_tokens(grids, n, m):
    unit = int(m.vision.params["merge"]) ** 2
    return [int(h * w) // unit for h, w in grids]


def _pooled(pixels, grid, m):
    k, budget = int(m.vision.params["pooling_kernel"]), len(pixels)
    return {"patches": pixels, "positions": image_pooled.positions(grid, budget)}, image_pooled.tokens(grid, k)


def _square_rows(m):
    return [(m.image.tile_size // m.image.patch_size) ** 2, 3 * m.image.patch_size ** 2]


TILE_INPUTS = {
    "unfold_patches": TileOp("unfold_patches", _unfold, lambda grids, n, m: [m.prompt.tokens_per_tile] * n,
                             _square_rows),
    "naflex_rows": TileOp("naflex_rows", _naflex,
                          lambda grids, n, m: naflex.tile_tokens(grids, m.vision.params["downsample_factor"]),
                          lambda m: [m.image.params["max_num_patches"], 3 * m.image.patch_size ** 2]),
    "native_grid": TileOp("native_grid", _native, _native_tokens,
                          lambda m: [m.image.params["max_patches"],
                                     3 * int(m.image.params["temporal_patch"]) * m.image.patch_size ** 2]),
    "pooled_positions": TileOp("pooled_positions", _pooled,
                               lambda grids, n, m: [image_pooled.tokens(g, int(m.vision.params["pooling_kernel"]))
                                                    for g in grids],
                               lambda m: [int(m.image.params["max_soft_tokens"]) * int(m.image.params["pooling_kernel"]) ** 2,
                                          3 * m.image.patch_size ** 2]),
}


def tile_op(vision) -> TileOp:
    if vision.tile_inputs not in TILE_INPUTS:
        raise ValueError(f"this vlmrt has no vision tile-inputs op {vision.tile_inputs!r}; upgrade vlmrt")
    return TILE_INPUTS[vision.tile_inputs]


def encode(session, pixels: np.ndarray, patch_grids: np.ndarray | None, m) -> np.ndarray:
    """The vision graph over each tile: [sum of the tiles' image tokens, hidden (+ the row outputs' width: each
    output's rows side by side, manifest vision.row_outputs)] (a padded tile's padding rows dropped)."""
    return np.concatenate(list(encode_tiles(session, pixels, patch_grids, m)))


def encode_tiles(session, pixels: np.ndarray, patch_grids: np.ndarray | None, m) -> Iterator[np.ndarray]:
    """encode's rows one tile at a time, one vision graph call each (a caller interleaves other work between tiles:
    under a batch, the other sequences' decode steps)."""
    op, v = tile_op(m.vision), m.vision
    names = {"patches": v.patches_input, **v.extra_inputs}
    dtypes = {t.name: t.dtype for t in m.graphs["vision"].inputs}
    for t in range(len(pixels)):
        feeds, n = op.feeds(pixels[t], None if patch_grids is None else patch_grids[t], m)
        feeds = {names[role]: a.astype(dtypes[names[role]], copy=False) for role, a in feeds.items()}
        outs = session.run([v.embeds_output, *v.row_outputs], feeds)
        take = slice(None, n) if isinstance(n, (int, np.integer)) else n
        yield np.concatenate([o[take] for o in outs], axis=1) if v.row_outputs else outs[0][take]
