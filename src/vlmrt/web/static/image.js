// Host image ops, as runtime/media/image.py: decode to RGB, tile (the manifest's named tiling op), rescale + normalize,
// unfold into patches. Every size rule is a line-by-line port of the Python one, and resizing is Pillow's
// (resample.js), so the tiles are the Python runtime's to the bit.

import { crop, resize } from "./resample.js";
import { NATIVE_TILING } from "./image_native.js";
import { POOLED_TILING } from "./image_pooled.js";

export const MAX_IMAGE_SIZE = 4096;  // transformers' SmolVLM/Idefics3 cap on the resized image
export const MAX_IMAGE_PIXELS = 120_000_000;  // runtime/media/image.py's limits
export const MAX_IMAGE_BYTES = 100 * 1024 * 1024;

export class ImageError extends Error {}

// Bytes of an image (a URL, a data URI, a Blob) -> {width, height, data: RGB}, transparency composited onto white
// and the EXIF orientation applied, as runtime/media/image.py's decode_image; the browser decodes (PNG is lossless, so the
// pixels are Pillow's; JPEG decoders may differ by a few levels).
export async function decodeImage(source) {
  let blob = source;
  if (typeof source === "string") {
    const r = await fetch(source);
    if (!r.ok) throw new ImageError(`cannot fetch image ${label(source)}: HTTP ${r.status}`);
    blob = await r.blob();
  }
  if (blob.size > MAX_IMAGE_BYTES) throw new ImageError(`image ${label(source)} is over ${MAX_IMAGE_BYTES >> 20} MiB`);
  let bmp;
  try {
    bmp = await createImageBitmap(blob, { colorSpaceConversion: "none", premultiplyAlpha: "none", imageOrientation: "from-image" });
  } catch (e) {
    throw new ImageError(`cannot read image ${label(source)}: not an image format this browser decodes`);
  }
  const { width, height } = bmp;
  if (width * height === 0) throw new ImageError(`image ${label(source)} has no pixels`);
  if (width * height > MAX_IMAGE_PIXELS) throw new ImageError(`image ${label(source)} is ${width}×${height} pixels; vlmrt reads images up to ${MAX_IMAGE_PIXELS / 1e6} million pixels`);
  const canvas = new OffscreenCanvas(width, height);
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.drawImage(bmp, 0, 0);
  bmp.close();
  const rgba = ctx.getImageData(0, 0, width, height, { colorSpace: "srgb" }).data;
  return fromRGBA(width, height, rgba);
}

// RGBA (not premultiplied) -> RGB over white, as Pillow's alpha_composite onto white then convert("RGB"); an opaque
// pixel is kept as it is.
export function fromRGBA(width, height, rgba) {
  const data = new Uint8Array(width * height * 3);
  for (let i = 0, j = 0; i < rgba.length; i += 4, j += 3) {
    const a = rgba[i + 3];
    if (a === 255) {
      data[j] = rgba[i]; data[j + 1] = rgba[i + 1]; data[j + 2] = rgba[i + 2];
    } else {
      // Pillow's alpha_composite onto opaque white (AlphaComposite.c, 7-bit coefficients: coef1 = a * 128); the
      // canvas keeps premultiplied pixels, so a half-transparent pixel may already be a level off Pillow's
      for (let c = 0; c < 3; c++) {
        const t = 128 * (rgba[i + c] * a + 255 * (255 - a)) + (0x80 << 7);
        data[j + c] = (((t >> 8) + t) >> 8) >> 7;
      }
    }
  }
  return { width, height, data };
}

function label(source) {
  if (typeof source !== "string") return "(blob)";
  return source.startsWith("data:") ? "data URI" : source.slice(0, 200);
}

const evenUp = (n) => (n % 2 ? n + 1 : n);

// runtime/media/image.py longest_edge_size: Idefics3's rescale to max len, then the 4096 cap
export function longestEdgeSize(height, width, longestEdge) {
  let aspect = width / height;
  if (width >= height) {
    width = longestEdge;
    height = evenUp(Math.trunc(longestEdge / aspect));
  } else {
    height = longestEdge;
    width = evenUp(Math.trunc(longestEdge * aspect));
  }
  height = Math.max(height, 1);
  width = Math.max(width, 1);
  aspect = width / height;
  if (width >= height && width > MAX_IMAGE_SIZE) {
    width = MAX_IMAGE_SIZE;
    height = Math.trunc(MAX_IMAGE_SIZE / aspect);
  } else if (height > width && height > MAX_IMAGE_SIZE) {
    height = MAX_IMAGE_SIZE;
    width = Math.trunc(MAX_IMAGE_SIZE * aspect);
  }
  return [Math.max(height, 1), Math.max(width, 1)];
}

// runtime/media/image.py tile_multiple_size: round sides up to multiples of the tile size
export function tileMultipleSize(height, width, tile) {
  const aspect = width / height;
  if (width >= height) {
    width = Math.ceil(width / tile) * tile;
    height = Math.ceil(Math.trunc(width / aspect) / tile) * tile;
  } else {
    height = Math.ceil(height / tile) * tile;
    width = Math.ceil(Math.trunc(height * aspect) / tile) * tile;
  }
  return [height, width];
}

function cut(im, tile, rows, cols) {
  const tiles = [];
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) tiles.push(crop(im, c * tile, r * tile, tile, tile));
  return tiles;
}

// SmolVLM / Idefics3: a rows×cols grid of full tiles + one global tile, row-major
function longestEdgeGrid(im, spec) {
  const tile = spec.tile_size, rs = spec.resample;
  let [h, w] = longestEdgeSize(im.height, im.width, spec.params.longest_edge);
  im = resize(im, w, h, rs);
  if (!(spec.params.split ?? true)) return [[resize(im, tile, tile, rs)], 0, 0];
  [h, w] = tileMultipleSize(h, w, tile);
  im = resize(im, w, h, rs);
  if (h <= tile && w <= tile) return [[im], 0, 0];
  const rows = Math.trunc((h - tile) / tile) + 1, cols = Math.trunc((w - tile) / tile) + 1;
  const tiles = cut(im, tile, rows, cols);
  tiles.push(resize(im, tile, tile, rs));
  return [tiles, rows, cols];
}

// runtime/media/image.py grid_candidates + best_grid (GotOcr2 / InternVL get_optimal_tiled_canvas)
export function bestGrid(height, width, tile, minTiles, maxTiles) {
  const grids = [];
  for (let c = 1; c <= maxTiles; c++) for (let r = 1; r <= maxTiles; r++) if (minTiles <= c * r && c * r <= maxTiles) grids.push([c, r]);
  grids.sort((a, b) => a[0] * a[1] - b[0] * b[1]);  // Array.prototype.sort is stable, as Python's sorted
  const aspect = width / height, area = width * height;
  let best = [1, 1], bestDiff = Infinity;
  for (const [cols, rows] of grids) {
    const diff = Math.abs(aspect - cols / rows);
    if (diff < bestDiff) {
      best = [cols, rows];
      bestDiff = diff;
    } else if (diff === bestDiff && area > 0.5 * tile * tile * cols * rows) {
      best = [cols, rows];
    }
  }
  return best;
}

// InternVL / GotOcr2: the closest-aspect grid of tiles, row-major, then a thumbnail when there is more than one
function closestAspectGrid(im, spec) {
  const tile = spec.tile_size, rs = spec.resample, p = spec.params;
  if (p.max_tiles <= 1) return [[resize(im, tile, tile, rs)], 1, 1];
  const [cols, rows] = bestGrid(im.height, im.width, tile, p.min_tiles, p.max_tiles);
  const big = resize(im, cols * tile, rows * tile, rs);
  const tiles = cut(big, tile, rows, cols);
  if ((p.thumbnail ?? true) && tiles.length > 1) tiles.push(resize(im, tile, tile, rs));
  return [tiles, rows, cols];
}

export const TILING = { longest_edge_grid: longestEdgeGrid, closest_aspect_grid: closestAspectGrid };

// uint8 tiles -> Float32Array [tiles, 3, S, S]: x * rescale (in float64, as transformers) rounded to float32, then
// (x - mean) / std in float32, as runtime/media/image.py normalize
export function normalize(tiles, spec) {
  const s = spec.tile_size, plane = s * s;
  const mean = spec.mean.map(Math.fround), std = spec.std.map(Math.fround);
  const out = new Float32Array(tiles.length * 3 * plane);
  tiles.forEach((t, i) => {
    for (let p = 0; p < plane; p++) {
      for (let c = 0; c < 3; c++) {
        const x = Math.fround(t.data[p * 3 + c] * spec.rescale_factor);
        out[(i * 3 + c) * plane + p] = Math.fround(Math.fround(x - mean[c]) / std[c]);
      }
    }
  });
  return out;
}

// {pixels [tiles, 3, S, S], grid [rows, cols, tiles]} of an RGB image, as runtime/media/image.py preprocess (a
// pooled tiling: its own pixels, with the patch grid and the image's tokens: image_pooled.js)
export function preprocess(im, spec) {
  if (NATIVE_TILING[spec.tiling]) return NATIVE_TILING[spec.tiling](im, spec);  // (one tile of patch rows: image_native.js)
  if (POOLED_TILING[spec.tiling]) return POOLED_TILING[spec.tiling](im, spec);
  const op = TILING[spec.tiling];
  if (!op) throw new ImageError(`this vlmrt has no image tiling op '${spec.tiling}'; upgrade vlmrt`);
  const [tiles, rows, cols] = op(im, spec);
  for (const t of tiles) {
    if (t.width !== spec.tile_size || t.height !== spec.tile_size) throw new Error(`tiling produced a ${t.width}×${t.height} tile`);
  }
  return { pixels: normalize(tiles, spec), grid: [rows, cols, tiles.length] };
}

// one tile [c, H, W] (at offset in pixels) -> [(H/p)*(W/p), c*p*p], rows in raster order, each row (c, py, px)
export function unfoldPatches(pixels, offset, s, patch) {
  const n = s / patch, rowLen = 3 * patch * patch;
  const out = new Float32Array(n * n * rowLen);
  for (let by = 0; by < n; by++) {
    for (let bx = 0; bx < n; bx++) {
      let o = (by * n + bx) * rowLen;
      for (let c = 0; c < 3; c++) {
        for (let py = 0; py < patch; py++) {
          const src = offset + (c * s + by * patch + py) * s + bx * patch;
          out.set(pixels.subarray(src, src + patch), o);
          o += patch;
        }
      }
    }
  }
  return out;
}
