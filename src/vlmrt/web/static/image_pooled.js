// Aspect-ratio patches for a pooling tower (Gemma 4), as runtime/media/image_pooled.py + tile_inputs.py
// "pooled_positions": the image resized (Pillow's filter, resample.js) keeping its aspect ratio to the largest sides
// that are multiples of kernel × patch within max_soft_tokens × kernel² patches, rescaled (and normalized), cut into
// patch rows in raster order, each row (py, px, c), zero rows after them up to the vision graph's budget; each real
// row's position its patch (x, y), (-1, -1) on padding. The tower pools each kernel² block into one image token:
// an image of gh × gw patches gives (gh / k)·(gw / k) tokens, the first rows of the graph's output.

import { resize } from "./resample.js";

export class PooledImageError extends Error {}

// transformers' gemma4 get_aspect_ratio_preserving_size: the resized [height, width] (image_pooled.pooled_size)
export function pooledSize(height, width, patch, maxPatches, kernel) {
  const targetPx = maxPatches * patch ** 2;
  const factor = Math.sqrt(targetPx / (height * width));
  const side = kernel * patch;
  let h = Math.floor(factor * height / side) * side;
  let w = Math.floor(factor * width / side) * side;
  if (h === 0 && w === 0) throw new PooledImageError(`a ${width}×${height} image cannot be resized to a multiple of ${side} pixels`);
  const longest = Math.trunc(maxPatches / kernel ** 2) * side;
  if (h === 0) {
    h = side;
    w = Math.min(Math.floor(width / height) * side, longest);
  } else if (w === 0) {
    w = side;
    h = Math.min(Math.floor(height / width) * side, longest);
  }
  if (h * w > targetPx) throw new PooledImageError(`a ${width}×${height} image resizes to ${w}×${h}, over ${maxPatches} patches`);
  return [h, w];
}

// image.tiling "pooled_aspect": an RGB image -> {pixels: Float32Array [budget, p·p·3] (zero rows after the real
// ones), grid: [token rows, token cols, 1 tile], patchGrid: [gh, gw], tileTokens: [the image's tokens]}
export function pooledAspect(im, spec) {
  const patch = spec.patch_size, kernel = spec.params.pooling_kernel;
  const budget = spec.params.max_soft_tokens * kernel ** 2;
  const [h, w] = pooledSize(im.height, im.width, patch, budget, kernel);
  if (h !== im.height || w !== im.width) im = resize(im, w, h, spec.resample);
  const mean = spec.mean.map(Math.fround), std = spec.std.map(Math.fround);
  const gh = h / patch, gw = w / patch, rowLen = patch * patch * 3;
  const out = new Float32Array(budget * rowLen);
  for (let y = 0; y < h; y++) {
    for (let x = 0; x < w; x++) {
      // patch (y / p, x / p) in raster order; within it (py, px, c)
      const o = ((Math.trunc(y / patch) * gw + Math.trunc(x / patch)) * patch + (y % patch)) * patch * 3 + (x % patch) * 3;
      for (let c = 0; c < 3; c++) {
        const v = Math.fround(im.data[(y * w + x) * 3 + c] * spec.rescale_factor);  // (float64 product, as numpy's)
        out[o + c] = Math.fround(Math.fround(v - mean[c]) / std[c]);
      }
    }
  }
  return { pixels: out, grid: [gh / kernel, gw / kernel, 1], patchGrid: [gh, gw], tileTokens: [(gh / kernel) * (gw / kernel)] };
}

// [budget, 2] int64: (x, y) of each real patch row in raster order, (-1, -1) after them
export function pooledPositions(patchGrid, budget) {
  const [gh, gw] = patchGrid, out = new BigInt64Array(budget * 2).fill(-1n);
  for (let i = 0; i < gh * gw; i++) {
    out[2 * i] = BigInt(i % gw);
    out[2 * i + 1] = BigInt(Math.trunc(i / gw));
  }
  return out;
}

// vision.tile_inputs "pooled_positions": the vision graph's feeds of one image and how many of its output rows are
// the image's tokens
function pooledFeeds(ort, image, m) {
  const rowLen = 3 * m.image.patch_size ** 2, budget = image.pixels.length / rowLen;
  return {
    feeds: {
      [m.vision.patches_input]: new ort.Tensor("float32", image.pixels, [budget, rowLen]),
      [m.vision.extra_inputs.positions]: new ort.Tensor("int64", pooledPositions(image.patchGrid, budget), [budget, 2]),
    },
    tokens: image.tileTokens[0],
  };
}

export const POOLED_TILING = { pooled_aspect: pooledAspect };
export const POOLED_TILE_INPUTS = { pooled_positions: pooledFeeds };
