"""Host image ops: load, tile, rescale/normalize, unfold into patches (Pillow + numpy).

Tiling strategies are named host ops; the manifest's `image.tiling` picks one and
`image.params` parameterizes it. Each returns the normalized tiles and the grid (rows, cols)
that prompt expansion needs; (0, 0) means one global tile, no grid. Most ops cut square
tiles of tile_size² (pixels [tiles, c, S, S]); the NaFlex op (`naflex_tiles`, LFM2-VL) gives
tiles of different sizes as padded patch rows (pixels [tiles, max_patches, patch² * c]) with
each tile's patch grid.
"""

from __future__ import annotations

import dataclasses
import io
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from struct import error as struct_error  # Pillow's parsers raise it on some truncated headers
from typing import TYPE_CHECKING

import numpy as np

from ..format.manifest import ImageSpec
from .aa_resize import resize as aa_resize
from .image_native import smart_resize_patches
from .pixels import RESAMPLE, ImageError, normalize, resample_filter as _resample  # noqa: F401  (ImageError, RESAMPLE: this module's API)

if TYPE_CHECKING:
    from PIL import Image
# Pillow is imported where an image is read, not with this module: a text-only run does not load it (cold start)
MAX_IMAGE_SIZE = 4096  # transformers' SmolVLM/Idefics3 cap on the resized image
# The largest image file load_image accepts (docs/limits.md): 120 million pixels (a 108 MP phone sensor's
# 12000×9000 fits; decoded as RGB that is 360 MB, Pillow's own bomb limit is 179 MP) and 100 MiB on disk.
# Checked from the header before any pixel is decoded.
MAX_IMAGE_PIXELS = 120_000_000
MAX_IMAGE_BYTES = 100 * 1024 * 1024


@dataclass
class Tiles:
    # float32, normalized: [tiles, channels, tile, tile]; NaFlex ops: [tiles, max_patches, patch * patch * channels],
    # each tile's patch rows in raster order, (py, px, c) within a row, zero rows after its patch_grids[t] h * w
    pixels: np.ndarray
    rows: int
    cols: int
    patch_grids: np.ndarray | None = None  # NaFlex ops: [tiles, 2] int64, each tile's (patch rows, patch columns)
    # the image was made smaller than its processor would make it, to fit the vision graph's patch budget
    resized_to_fit: bool = False

    @property
    def grid(self) -> tuple[int, int, int]:
        """(rows, cols, tiles) — what prompt expansion needs."""
        return self.rows, self.cols, len(self.pixels)


def is_pil_image(x) -> bool:
    """Whether x is a PIL image (without importing Pillow: if it is not loaded, x is none). PIL.Image may be in
    sys.modules before it is whole (another thread importing it): without its Image class yet, x is none either."""
    cls = getattr(sys.modules.get("PIL.Image"), "Image", None)
    return cls is not None and isinstance(x, cls)


def load_image(path: str | Path) -> Image.Image:
    """Open an image file as RGB (see decode_image); a file over MAX_IMAGE_BYTES is refused before it is read."""
    path = Path(path)
    if not path.is_file():
        raise ImageError(f"image not found: {path}")
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"image {path} is {size / 2**20:.0f} MiB; vlmrt reads images up to {MAX_IMAGE_BYTES >> 20} MiB")
    return decode_image(path, str(path))


def decode_image(source: Path | bytes, label: str) -> Image.Image:
    """An image file or its bytes as RGB, as transformers' `load_image` does: the EXIF orientation applied (phone
    photos), transparency composited onto white; the first frame of an animation. An image over MAX_IMAGE_PIXELS is
    refused before its pixels are decoded; anything Pillow cannot decode is one ImageError naming label."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow warns on oddities it reads past (a truncated TIFF tag, a bomb under its own limit: ours is checked
            # below); the result is what matters: an image, or one error line, never a Python warning on stderr
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
                if im.width * im.height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"image {label} is {im.width}×{im.height} pixels; vlmrt reads images up to "
                                     f"{MAX_IMAGE_PIXELS / 1e6:.0f} million pixels")
                im.load()
                im = ImageOps.exif_transpose(im)
                if im.width * im.height == 0:
                    raise ImageError(f"image {label} has no pixels ({im.width}×{im.height})")
                return to_rgb(im)
    except Image.DecompressionBombError as e:  # over Pillow's own limit, refused by Image.open
        raise ImageError(f"image {label} is too large to decode safely: {str(e).split('.')[0]}") from None
    except UnidentifiedImageError:  # its message is "cannot identify image file <_io.BytesIO object at 0x...>"
        empty = (len(source) if isinstance(source, bytes) else Path(source).stat().st_size) == 0
        what = "the file is empty" if empty else "not an image format Pillow reads, or its header is corrupt"
        raise ImageError(f"cannot read image {label}: {what}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct_error, MemoryError) as e:
        raise ImageError(f"cannot read image {label}: {e or type(e).__name__}") from None


def to_rgb(im: Image.Image) -> Image.Image:
    from PIL import Image

    if "A" in im.getbands() or im.info.get("transparency") is not None:
        im = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im).convert("RGB")
    return im.convert("RGB")


def _even_up(n: int) -> int:
    return n + 1 if n % 2 else n


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Idefics3 `_resize_output_size_rescale_to_max_len` then `_scale_below_upper_bound(4096)`."""
    aspect = width / height
    if width >= height:
        width, height = longest_edge, _even_up(int(longest_edge / aspect))
    else:
        height, width = longest_edge, _even_up(int(longest_edge * aspect))
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3 `resize_for_vision_encoder`: round sides up to multiples of the tile size."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def longest_edge_grid(im: Image.Image, spec: ImageSpec) -> tuple[list[Image.Image], int, int]:
    """SmolVLM / Idefics3 tiling: a rows×cols grid of full tiles + one global tile, row-major."""
    tile, resample = spec.tile_size, _resample(spec.resample)
    h, w = longest_edge_size(im.height, im.width, spec.params["longest_edge"])
    im = im.resize((w, h), resample=resample)
    if not spec.params.get("split", True):
        return [im.resize((tile, tile), resample=resample)], 0, 0
    h, w = tile_multiple_size(h, w, tile)
    im = im.resize((w, h), resample=resample)
    if h <= tile and w <= tile:
        return [im], 0, 0
    rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
    tiles = [im.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    tiles.append(im.resize((tile, tile), resample=resample))
    return tiles, rows, cols


def grid_candidates(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(cols, rows) grids with min <= cols*rows <= max, by tile count (stable)."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if min_tiles <= c * r <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def best_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int,
              candidates: list[tuple[int, int]] | None = None) -> tuple[int, int]:
    """GotOcr2 / InternVL `get_optimal_tiled_canvas`: the grid whose aspect ratio is closest to the
    image's; on a tie the later candidate, while the image area exceeds half of the grid's pixel area.
    candidates: (cols, rows) in the order they are tried (default grid_candidates')."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in candidates or grid_candidates(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def closest_aspect_grid(im: Image.Image, spec: ImageSpec) -> tuple[list[Image.Image], int, int]:
    """InternVL / GotOcr2 tiling: resize to the closest-aspect grid of tiles, cut row-major, then a
    thumbnail of the whole image when there is more than one tile."""
    tile, resample, p = spec.tile_size, _resample(spec.resample), spec.params
    if p["max_tiles"] <= 1:
        return [im.resize((tile, tile), resample=resample)], 1, 1
    cols, rows = best_grid(im.height, im.width, tile, p["min_tiles"], p["max_tiles"])
    big = im.resize((cols * tile, rows * tile), resample=resample)
    tiles = [big.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    if p.get("thumbnail", True) and len(tiles) > 1:
        tiles.append(im.resize((tile, tile), resample=resample))
    return tiles, rows, cols


def _round_by(n: float, factor: int) -> int:
    return round(n / factor) * factor  # Python's round: half to even, as transformers' round_by_factor


def naflex_size(height: int, width: int, p: dict) -> tuple[int, int]:
    """LFM2-VL `smart_resize`: (height, width) in multiples of patch * downsample, the aspect kept, the pixel count
    within min_image_tokens..max_image_tokens tokens (a token = downsample² patches)."""
    f = p["patch_size"] * p["downsample_factor"]
    lo = p["min_image_tokens"] * f * f
    hi = p["max_image_tokens"] * f * f
    h, w = max(f, _round_by(height, f)), max(f, _round_by(width, f))
    if h * w > hi:
        beta = math.sqrt(height * width / hi)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def naflex_is_large(height: int, width: int, p: dict) -> bool:
    """LFM2-VL `_is_image_too_large`: whether the image is split into tiles (beyond max_pixels_tolerance × the
    max_image_tokens budget once rounded)."""
    f = p["patch_size"] * p["downsample_factor"]
    h, w = max(p["patch_size"], _round_by(height, f)), max(p["patch_size"], _round_by(width, f))
    return h * w > p["max_image_tokens"] * f * f * p["max_pixels_tolerance"]


def naflex_grids(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """LFM2-VL `_target_ratios`: (cols, rows) with min <= cols*rows <= max, ordered as transformers orders them
    (sorted by tile count from a Python set: the order among equal counts decides exact aspect ties)."""
    ratios = [(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1) for h in range(1, n + 1)
              if min_tiles <= w * h <= max_tiles]
    return sorted(set(ratios), key=lambda r: r[0] * r[1])


def patch_rows(x: np.ndarray, patch: int) -> np.ndarray:
    """[H, W, c] -> [(H/p)*(W/p), p*p*c]: patches in raster order, each row ordered (py, px, c) — the layout of
    SigLIP2's patch embedding (a Linear over the flattened patch), as transformers' convert_image_to_patches."""
    h, w, c = x.shape
    x = x.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 1, 3, 4)
    return x.reshape((h // patch) * (w // patch), patch * patch * c)


def naflex_tiles(im: Image.Image, spec: ImageSpec) -> Tiles:
    """LFM2-VL's Lfm2VlImageProcessor (SigLIP2 NaFlex): an image within the token budget is resized to
    naflex_size (sides in multiples of patch * downsample_factor) and is one tile; a larger one (naflex_is_large,
    and params.split) is resized to the closest-aspect grid of tile_size² tiles, cut row-major, plus a thumbnail of
    the whole image at naflex_size (params.use_thumbnail, more than one tile). Resizes are torchvision's antialiased
    bilinear uint8 arithmetic (aa_resize.py); each tile becomes its patch rows, zero-padded to
    params.max_num_patches, with its patch grid."""
    if spec.resample != "bilinear":
        raise ImageError(f"the naflex_tiles op resizes with torchvision's antialiased bilinear filter, not {spec.resample!r}")
    p = {**spec.params, "patch_size": spec.patch_size}
    tile, patch = spec.tile_size, spec.patch_size
    x = np.asarray(im, dtype=np.uint8)
    if x.ndim != 3 or x.shape[2] != 3:
        raise ImageError(f"naflex_tiles takes an RGB image, not {im.mode}")
    height, width = x.shape[:2]
    h, w = naflex_size(height, width, p)
    split = p.get("split", True) and not p["min_tiles"] == p["max_tiles"] == 1
    rows = cols = 1
    if split and naflex_is_large(height, width, p):
        cols, rows = best_grid(height, width, tile, p["min_tiles"], p["max_tiles"],
                               naflex_grids(p["min_tiles"], p["max_tiles"]))
        big = aa_resize(x, rows * tile, cols * tile, "bilinear")
        tiles = [big[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
        if p.get("use_thumbnail", True) and rows * cols != 1:
            tiles.append(aa_resize(x, h, w, "bilinear"))
    else:
        tiles = [aa_resize(x, h, w, "bilinear")]
    # transformers fuses rescale into normalize: (x - mean / rescale) / (std / rescale), in float32
    mean = np.asarray(spec.mean, np.float32) * np.float32(1.0 / spec.rescale_factor)
    std = np.asarray(spec.std, np.float32) * np.float32(1.0 / spec.rescale_factor)
    pixels = np.zeros((len(tiles), p["max_num_patches"], patch * patch * 3), np.float32)
    grids = np.zeros((len(tiles), 2), np.int64)
    for i, t in enumerate(tiles):
        rows_i = patch_rows((t.astype(np.float32) - mean) / std, patch)
        if len(rows_i) > p["max_num_patches"]:
            raise ImageError(f"a {t.shape[0]}×{t.shape[1]} tile has {len(rows_i)} patches; the bundle's vision graph "
                             f"takes {p['max_num_patches']}")
        pixels[i, :len(rows_i)] = rows_i
        grids[i] = t.shape[0] // patch, t.shape[1] // patch
    return Tiles(pixels, 0 if rows * cols == 1 else rows, 0 if rows * cols == 1 else cols, grids)


def square_tiles(op):
    """A tiling op that cuts tile_size² uint8 tiles ((tiles, rows, cols)) as one that returns Tiles: the tiles
    checked and normalized into [tiles, c, S, S]."""
    def tiled(im: Image.Image, spec: ImageSpec) -> Tiles:
        tiles, rows, cols = op(im, spec)
        for t in tiles:
            if t.size != (spec.tile_size, spec.tile_size):
                raise AssertionError(f"tiling produced a {t.size} tile, expected {spec.tile_size}²")
        return Tiles(normalize(tiles, spec), rows, cols)

    return tiled


def smart_resize(im: Image.Image, spec: ImageSpec) -> Tiles:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL's native resolution (runtime/image_native.py): one tile, its patch rows
    [1, patches, c·t·p²] in the processor's order under the patch budget; (rows, cols) its token grid (merge
    blocks), patch_grids its patch grid."""
    p = smart_resize_patches(im, spec)
    merge = int(spec.params["merge"])
    _, gh, gw = p.grid
    return Tiles(p.patches[None], gh // merge, gw // merge, np.array([[gh, gw]], np.int64), p.budget_limited)


# image.tiling -> (image, spec) -> Tiles
TILING = {"longest_edge_grid": square_tiles(longest_edge_grid), "closest_aspect_grid": square_tiles(closest_aspect_grid),
          "naflex_tiles": naflex_tiles, "smart_resize": smart_resize}


def with_max_tiles(spec: ImageSpec, max_tiles: int | None) -> ImageSpec:
    """The spec with a user's tile cap (`vlmrt run --max-tiles`), for tiling ops that have one."""
    if max_tiles is None:
        return spec
    if "max_tiles" not in spec.params:
        raise ImageError(f"this bundle's tiling ({spec.tiling}) has no tile-count setting; --max-tiles does not apply")
    if max_tiles < max(1, spec.params.get("min_tiles", 1)):
        raise ImageError(f"--max-tiles must be >= {max(1, spec.params.get('min_tiles', 1))}")
    return dataclasses.replace(spec, params={**spec.params, "max_tiles": max_tiles})


def preprocess(im: Image.Image, spec: ImageSpec) -> Tiles:
    if spec.tiling not in TILING:
        raise ImageError(f"this vlmrt has no image tiling op {spec.tiling!r}; upgrade vlmrt")
    return TILING[spec.tiling](im, spec)


def unfold_patches(tile: np.ndarray, patch: int) -> np.ndarray:
    """[c, H, W] -> [(H/p)*(W/p), c*p*p], rows in raster order, each row ordered (c, py, px)
    — the layout of a Conv2d(kernel=stride=p) weight flattened to [out, c*p*p]."""
    c, h, w = tile.shape
    x = tile.reshape(c, h // patch, patch, w // patch, patch).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(x.reshape((h // patch) * (w // patch), c * patch * patch))
