"""Host image ops: load, tile, rescale/normalize, unfold into patches (Pillow + numpy).

Tiling strategies are named host ops; the manifest's `image.tiling` picks one and
`image.params` parameterizes it. Each returns the normalized tiles and the grid (rows, cols)
that prompt expansion needs; (0, 0) means one global tile, no grid. Most ops cut square
tiles of tile_size² (pixels [tiles, c, S, S]); the NaFlex op (`naflex_tiles`, LFM2-VL) gives
tiles of different sizes as padded patch rows (pixels [tiles, max_patches, patch² * c]) with
each tile's patch grid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from struct import error as struct_error  # Pillow's parsers raise it on some truncated headers
from typing import TYPE_CHECKING

import numpy as np

from ...format.manifest import ImageSpec
from .aa_resize import resize as aa_resize
from . import image_pooled
from .image_native import budget_size, smart_resize_patches
from .pixels import RESAMPLE, ImageError, normalize, resample_filter as _resample  # noqa: F401  (ImageError, RESAMPLE: this module's API)

if TYPE_CHECKING:
    from PIL import Image
# Pillow is imported where an image is read, not with this module: a text-only run does not load it (cold start)
MAX_IMAGE_SIZE = 4096  # transformers' SmolVLM/Idefics3 cap on the resized image
# The largest image file load_image accepts (docs/limits.md): 120 million pixels (a 108 MP phone sensor's
# 12000×9000 fits; decoded as RGB that is 480 MB, Pillow's own bomb limit is 179 MP) and 100 MiB on disk.
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


class TooManyPixels(ImageError):
    """An image, or a request's images, over a decoded-pixel limit (refused from the headers)."""


@dataclass(frozen=True)
class Header:
    """What an image's header says, before any pixel is decoded: the size the processor sees (EXIF orientation
    applied) and what decoding it will allocate (a JPEG the processor shrinks a lot is decoded at 1/2, 1/4 or 1/8 of
    its size by libjpeg's scaled IDCT: `Image.draft`; see draft_request)."""

    size: tuple[int, int]  # (width, height) the processor decides from: the source's, oriented
    decoded: tuple[int, int]  # (width, height) as decoded (before orientation): smaller than the stored one if drafted
    draft: tuple[int, int] | None  # the size asked of Image.draft (stored orientation), or None: decoded whole

    @property
    def pixels(self) -> int:
        """Pixels decoded: what the decoded-pixel budgets count."""
        return self.decoded[0] * self.decoded[1]


@contextlib.contextmanager
def _opened(source: Path | bytes, label: str, max_pixels: int = MAX_IMAGE_PIXELS):
    """The lazily opened image (Image.open reads the header only); Pillow's failures as one ImageError naming label.
    Pillow's own bomb limit (2 × its MAX_IMAGE_PIXELS, checked by Image.open) is lifted for this open when max_pixels is
    over it: vlmrt's limit is checked from the header (read_header) before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow warns on oddities it reads past (a truncated TIFF tag, a bomb under its own limit: ours is checked
            # from the header); the result is what matters: an image, or one error line, never a Python warning
            warnings.simplefilter("ignore")
            with _open(Image, source, max_pixels) as im:
                yield im
    except Image.DecompressionBombError as e:  # over Pillow's own limit, refused by Image.open
        raise ImageError(f"image {label} is too large to decode safely: {str(e).split('.')[0]}") from None
    except UnidentifiedImageError:  # its message is "cannot identify image file <_io.BytesIO object at 0x...>"
        empty = (len(source) if isinstance(source, bytes) else Path(source).stat().st_size) == 0
        what = "the file is empty" if empty else "not an image format Pillow reads, or its header is corrupt"
        raise ImageError(f"cannot read image {label}: {what}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct_error, MemoryError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"cannot read image {label}: {e or type(e).__name__}") from None


def _open(Image, source: Path | bytes, max_pixels: int):
    fp = io.BytesIO(source) if isinstance(source, bytes) else source
    bomb = Image.MAX_IMAGE_PIXELS
    if bomb is None or max_pixels <= 2 * bomb:
        return Image.open(fp)
    with _BOMB_LOCK:  # Image.open reads the module's limit: lifted for this call only
        Image.MAX_IMAGE_PIXELS = None
        try:
            return Image.open(fp)
        finally:
            Image.MAX_IMAGE_PIXELS = bomb


_BOMB_LOCK = threading.Lock()


def read_header(im: Image.Image, label: str, spec: ImageSpec | None = None,
                max_pixels: int = MAX_IMAGE_PIXELS) -> Header:
    """The Header of a lazily opened image: refused (ImageError) over max_pixels; the JPEG draft that spec's processor
    allows (draft_request)."""
    width, height = im.size
    if width * height > max_pixels:
        raise TooManyPixels(f"image {label} is {width}×{height} pixels; vlmrt reads images up to "
                         f"{max_pixels / 1e6:g} million pixels")
    if width * height == 0:
        raise ImageError(f"image {label} has no pixels ({width}×{height})")
    if spec is None or im.format != "JPEG" or len(im.tile) != 1:  # only a JPEG decodes smaller
        return Header((width, height), (width, height), None)
    # a JPEG's EXIF is read with its header (for a PNG, getexif may decode the image: it is not asked)
    turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # rotated by 90°: the processor sees height × width
    size = (height, width) if turned else (width, height)
    ask = draft_request(spec, *size)
    if ask is None:
        return Header(size, (width, height), None)
    ask = (ask[1], ask[0]) if turned else ask
    scale = _draft_scale(width, height, ask)
    if scale == 1:
        return Header(size, (width, height), None)
    return Header(size, (-(-width // scale), -(-height // scale)), ask)


def _draft_scale(width: int, height: int, ask: tuple[int, int]) -> int:
    """The scale JpegImageFile.draft picks for a request (its rule: the largest of 8, 4, 2, 1 not over either ratio)."""
    ratio = min(width // ask[0], height // ask[1])
    return next(s for s in (8, 4, 2, 1) if ratio >= s)


def decode_image(source: Path | bytes, label: str, spec: ImageSpec | None = None,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """An image file or its bytes as RGB, as transformers' `load_image` does: the EXIF orientation applied (phone
    photos), transparency composited onto white; the first frame of an animation. An image over max_pixels is
    refused before its pixels are decoded; anything Pillow cannot decode is one ImageError naming label.
    spec: the bundle's image op; a JPEG that its processor shrinks enough is decoded smaller (draft_request), and the
    image then carries its source size for the processor's decisions (source_size)."""
    from PIL import ImageOps

    with _opened(source, label, max_pixels) as im:
        head = read_header(im, label, spec, max_pixels)
        if head.draft is not None:
            im.draft(im.mode, head.draft)
            if im.size != head.decoded:  # Pillow's rule is the one _draft_scale follows; never guess otherwise
                raise AssertionError(f"JPEG draft gave {im.size}, expected {head.decoded}")
        im.load()
        ImageOps.exif_transpose(im, in_place=True)  # not a copy: to_rgb makes the one image returned
        if im.width * im.height == 0:
            raise ImageError(f"image {label} has no pixels ({im.width}×{im.height})")
        out = to_rgb(im)
    if head.draft is not None:
        out.info[SOURCE_SIZE] = head.size
    return out


def probe_image(source: Path | bytes, label: str, spec: ImageSpec | None = None,
                max_pixels: int = MAX_IMAGE_PIXELS) -> Header:
    """The Header of an image file or its bytes (no pixel decoded); the same refusals as decode_image's header."""
    with _opened(source, label, max_pixels) as im:
        return read_header(im, label, spec, max_pixels)


# A JPEG is decoded at a reduced scale (Image.draft: libjpeg's scaled IDCT, 1/2, 1/4 or 1/8) only when all of this
# holds, so that answers stay those of a whole decode wherever that is cheap (docs/limits.md, "Decoded pixels"):
DRAFT_MIN_PIXELS = 16_000_000  # the source is over 16 million pixels (a 12 MP phone photo is decoded whole)
DRAFT_MARGIN = 2  # the reduced image is still >= 2× the processor's largest resize of it on each side
SOURCE_SIZE = "vlmrt.source_size"  # PIL info key: (width, height) of a drafted image's source


def source_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) the image ops decide from (grid, resized size): the source's, for an image decoded smaller."""
    w, h = im.info.get(SOURCE_SIZE, im.size)
    return int(w), int(h)


def processor_size(spec: ImageSpec, width: int, height: int) -> tuple[int, int]:
    """(width, height): the largest size, per side, that spec's image op resizes a width × height source to (the
    images it resizes from the source itself; later resizes start from those)."""
    p = spec.params
    if spec.tiling == "longest_edge_grid":
        h, w = longest_edge_size(height, width, p["longest_edge"])
        return w, h
    if spec.tiling == "closest_aspect_grid":
        if p["max_tiles"] <= 1:
            return spec.tile_size, spec.tile_size
        cols, rows = best_grid(height, width, spec.tile_size, p["min_tiles"], p["max_tiles"])
        return max(cols, 1) * spec.tile_size, max(rows, 1) * spec.tile_size
    if spec.tiling == "naflex_tiles":
        q = {**p, "patch_size": spec.patch_size}
        h, w = naflex_size(height, width, q)
        if p.get("split", True) and not p["min_tiles"] == p["max_tiles"] == 1 and naflex_is_large(height, width, q):
            cols, rows = best_grid(height, width, spec.tile_size, p["min_tiles"], p["max_tiles"],
                                   naflex_grids(p["min_tiles"], p["max_tiles"]))
            return max(w, cols * spec.tile_size), max(h, rows * spec.tile_size)
        return w, h
    if spec.tiling == "smart_resize":
        h, w, _ = budget_size(height, width, spec.patch_size, int(p["merge"]), int(p["min_pixels"]),
                              int(p["max_pixels"]), int(p["max_patches"]))
        return w, h
    raise ImageError(f"this vlmrt has no image tiling op {spec.tiling!r}; upgrade vlmrt")


def draft_request(spec: ImageSpec, width: int, height: int) -> tuple[int, int] | None:
    """The smallest (width, height) a JPEG of this (oriented) size may be decoded to for spec's processor, or None:
    decode it whole (a source of at most DRAFT_MIN_PIXELS, or one whose processor asks for more than half of it)."""
    if width * height <= DRAFT_MIN_PIXELS:
        return None
    try:
        w, h = processor_size(spec, width, height)
    except (ImageError, KeyError, ValueError, ZeroDivisionError):  # the image op's own refusal comes later, as before
        return None
    ask = (DRAFT_MARGIN * w, DRAFT_MARGIN * h)
    return ask if width // ask[0] >= 2 and height // ask[1] >= 2 else None


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
    width, height = source_size(im)
    h, w = longest_edge_size(height, width, spec.params["longest_edge"])
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
    width, height = source_size(im)
    cols, rows = best_grid(height, width, tile, p["min_tiles"], p["max_tiles"])
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
    width, height = source_size(im)
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
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL's native resolution (runtime/media/image_native.py): one tile, its patch rows
    [1, patches, c·t·p²] in the processor's order under the patch budget; (rows, cols) its token grid (merge
    blocks), patch_grids its patch grid."""
    p = smart_resize_patches(im, spec)
    merge = int(spec.params["merge"])
    _, gh, gw = p.grid
    return Tiles(p.patches[None], gh // merge, gw // merge, np.array([[gh, gw]], np.int64), p.budget_limited)


def pooled_aspect(im: Image.Image, spec: ImageSpec) -> Tiles:
    """Gemma 4's aspect-ratio patches (runtime/media/image_pooled.py): one tile, its patch rows [1, budget, p²·3]
    padded to the graph's budget; (rows, cols) its token grid (pooling kernels), patch_grids its patch grid."""
    rows, grid = image_pooled.pooled_patches(im, spec)
    k = int(spec.params["pooling_kernel"])
    return Tiles(rows[None], int(grid[0]) // k, int(grid[1]) // k, grid[None])


def pooled_aspect_tensor(im: Image.Image, spec: ImageSpec) -> Tiles:
    """Gemma 4's video frames (Gemma4VideoProcessor): pooled_aspect's patches resized by torchvision's antialiased
    uint8 resize, as the video processor resizes frame tensors."""
    rows, grid = image_pooled.pooled_patches(im, spec, tensor_resize=True)
    k = int(spec.params["pooling_kernel"])
    return Tiles(rows[None], int(grid[0]) // k, int(grid[1]) // k, grid[None])


# image.tiling -> (image, spec) -> Tiles
TILING = {"longest_edge_grid": square_tiles(longest_edge_grid), "closest_aspect_grid": square_tiles(closest_aspect_grid),
          "naflex_tiles": naflex_tiles, "smart_resize": smart_resize, "pooled_aspect": pooled_aspect,
          "pooled_aspect_tensor": pooled_aspect_tensor}


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
