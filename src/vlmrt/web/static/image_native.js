// Native-resolution images (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5's processor), as runtime/media/image_native.py
// and vision_inputs.py: the image resized (Pillow's filters: resample.js) to sides that are multiples of
// patch × merge under the vision graph's patch budget, normalized, cut into patch rows in merge-block order; then
// the vision graph's inputs for its grid (tile-inputs op "native_grid": rows padded to the budget, the 2-D rotary,
// Qwen2.5-VL's window order and masks or Qwen3-VL's position interpolation, the attention mask). Every rule is a
// line-by-line port of the Python one (float32 where it computes in float32), so the graph's inputs are the Python
// runtime's to the bit.

import { resize } from "./resample.js";

export const MAX_ASPECT = 200;

export class NativeImageError extends Error {}

// Python's round(): halves to even
function roundHalfEven(x) {
  const f = Math.floor(x), d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

// image_native.smart_resize
export function smartResize(height, width, factor, minPixels, maxPixels) {
  if (Math.max(height, width) / Math.min(height, width) > MAX_ASPECT) {
    throw new NativeImageError(`the image's aspect ratio is ${(Math.max(height, width) / Math.min(height, width)).toFixed(0)}:1; this model's image processor takes up to ${MAX_ASPECT}:1`);
  }
  let hBar = roundHalfEven(height / factor) * factor, wBar = roundHalfEven(width / factor) * factor;
  if (hBar * wBar > maxPixels) {
    const beta = Math.sqrt((height * width) / maxPixels);
    hBar = Math.max(factor, Math.floor(height / beta / factor) * factor);
    wBar = Math.max(factor, Math.floor(width / beta / factor) * factor);
  } else if (hBar * wBar < minPixels) {
    const beta = Math.sqrt(minPixels / (height * width));
    hBar = Math.ceil((height * beta) / factor) * factor;
    wBar = Math.ceil((width * beta) / factor) * factor;
  }
  return [hBar, wBar];
}

// image_native.budget_size: [height, width] under the patch budget
export function budgetSize(height, width, patch, merge, minPixels, maxPixels, maxPatches) {
  const factor = patch * merge;
  if (maxPatches < merge * merge) throw new NativeImageError(`a patch budget of ${maxPatches} patches is below one merge block (${merge * merge})`);
  let [h, w] = smartResize(height, width, factor, minPixels, Math.min(maxPixels, maxPatches * patch * patch));
  if ((h / patch) * (w / patch) > maxPatches) {
    const blocks = Math.floor(maxPatches / (merge * merge));
    const short = Math.min(Math.floor(Math.min(h, w) / factor), blocks), long = Math.floor(blocks / short);
    [h, w] = h <= w ? [short * factor, long * factor] : [long * factor, short * factor];
  }
  return [h, w];
}

// image_native.patchify of the normalized image: [(h/p)*(w/p), 3*temporal*p*p] in merge-block order, each row
// (channel, temporal, py, px), the image repeated along the temporal axis
function patchify(im, spec, h, w) {
  const p = spec.patch_size, merge = spec.params.merge, temporal = spec.params.temporal_patch;
  const mean = spec.mean.map(Math.fround), std = spec.std.map(Math.fround);
  const gh = h / p, gw = w / p, rowLen = 3 * temporal * p * p, out = new Float32Array(gh * gw * rowLen);
  // x * rescale (float64, as transformers) rounded to float32, then (x - mean) / std in float32 (pixels.normalize)
  const value = (y, x, c) => {
    const v = Math.fround(im.data[(y * w + x) * 3 + c] * spec.rescale_factor);
    return Math.fround(Math.fround(v - mean[c]) / std[c]);
  };
  let o = 0;
  for (let by = 0; by < gh / merge; by++) {
    for (let bx = 0; bx < gw / merge; bx++) {
      for (let my = 0; my < merge; my++) {
        for (let mx = 0; mx < merge; mx++) {
          const y0 = (by * merge + my) * p, x0 = (bx * merge + mx) * p;
          for (let c = 0; c < 3; c++) {
            for (let t = 0; t < temporal; t++) {
              for (let py = 0; py < p; py++) for (let px = 0; px < p; px++) out[o++] = value(y0 + py, x0 + px, c);
            }
          }
        }
      }
    }
  }
  return out;
}

// image.smart_resize: {pixels [patches * row], grid [rows, cols, 1] in tokens (merge blocks), patchGrid [h, w],
// tileTokens [rows * cols] (the prompt expansion's count: one token per merge block)}
export function smartResizeImage(im, spec) {
  const q = spec.params, p = spec.patch_size;
  const [h, w] = budgetSize(im.height, im.width, p, q.merge, q.min_pixels, q.max_pixels, q.max_patches);
  if (h !== im.height || w !== im.width) im = resize(im, w, h, spec.resample);
  const rows = h / p / q.merge, cols = w / p / q.merge;
  return { pixels: patchify(im, spec, h, w), grid: [rows, cols, 1], patchGrid: [h / p, w / p], tileTokens: [rows * cols] };
}

export const NATIVE_TILING = { smart_resize: smartResizeImage };

// ---------------------------------------------------------------------------- the vision graph's inputs

// vision_inputs.merge_block_positions: (row, col) of each patch in merge-block order
function blockPositions(gh, gw, merge) {
  const rows = [], cols = [];
  for (let by = 0; by < gh / merge; by++) for (let bx = 0; bx < gw / merge; bx++) {
    for (let my = 0; my < merge; my++) for (let mx = 0; mx < merge; mx++) { rows.push(by * merge + my); cols.push(bx * merge + mx); }
  }
  return [rows, cols];
}

// vision_inputs.rotary_2d: cos, sin [n * headDim] float32
function rotary2d(gh, gw, merge, headDim, theta) {
  const half = headDim / 2, quarter = half / 2;
  const inv = Array.from({ length: quarter }, (_, i) => Math.fround(1.0 / theta ** ((2 * i) / half)));
  const [rows, cols] = blockPositions(gh, gw, merge), n = rows.length;
  const cos = new Float32Array(n * headDim), sin = new Float32Array(n * headDim);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < half; j++) {
      const a = Math.fround((j < quarter ? rows[i] : cols[i]) * inv[j % quarter]);
      cos[i * headDim + j] = cos[i * headDim + half + j] = Math.cos(a);
      sin[i * headDim + j] = sin[i * headDim + half + j] = Math.sin(a);
    }
  }
  return [cos, sin];
}

// vision_inputs.window_order: [order of the merge blocks, each one's window]
function windowOrder(gh, gw, merge, window, patch) {
  const side = window / merge / patch, bh = gh / merge, bw = gw / merge;
  const ph = bh + side - (bh % side), pw = bw + side - (bw % side);
  const order = [], wins = [];
  let win = 0;
  for (let wy = 0; wy < ph / side; wy++) for (let wx = 0; wx < pw / side; wx++, win++) {
    for (let y = wy * side; y < (wy + 1) * side; y++) for (let x = wx * side; x < (wx + 1) * side; x++) {
      if (y < bh && x < bw) { order.push(y * bw + x); wins.push(win); }
    }
  }
  return [order, wins];
}

// vision_inputs.interpolated_positions: indices [n * 4] (int64), weights [n * 4] float32, bilinear with aligned corners
function interpolatedPositions(gh, gw, merge, side) {
  const [rows, cols] = blockPositions(gh, gw, merge), n = rows.length, f = Math.fround;
  const axis = (i, size) => {
    const src = f(f(i * f(side - 1)) / f(Math.max(size - 1, 1))), floor = Math.floor(src);
    return [0, 1].map((o) => [Math.min(Math.max(floor + o, 0), side - 1), Math.max(f(1 - f(Math.abs(f(f(src - floor) - o)))), 0)]);
  };
  const index = new BigInt64Array(n * 4), weight = new Float32Array(n * 4);
  for (let i = 0; i < n; i++) {
    const hs = axis(rows[i], gh), ws = axis(cols[i], gw);
    for (let a = 0; a < 2; a++) for (let b = 0; b < 2; b++) {
      index[i * 4 + a * 2 + b] = BigInt(hs[a][0] * side + ws[b][0]);
      weight[i * 4 + a * 2 + b] = f(hs[a][1] * ws[b][1]);
    }
  }
  return [index, weight];
}

// vision_inputs.segment_mask over padded_segments: 0 where both rows are in one segment (padding: -1), else value
function segmentMask(segments, rows, value) {
  const seg = new Float64Array(rows).fill(-1);
  seg.set(segments);
  const m = new Float32Array(rows * rows);
  for (let i = 0; i < rows; i++) for (let j = 0; j < rows; j++) m[i * rows + j] = seg[i] === seg[j] ? 0 : value;
  return m;
}

// tile_inputs "native_grid" (vision_inputs.build_feeds): {feeds: {role: [type, data, dims]}, tokens, order} for one
// image's patch rows (patchRows of rowLen values, merge-block order) of patch grid [gh, gw], in a graph of `rows`
// patch rows; order (window_order): output row i is the image's token order[i]
export function nativeGridFeeds(pixels, patchGrid, params, rows, rowLen) {
  const [gh, gw] = patchGrid, merge = params.merge, unit = merge * merge, n = gh * gw, ops = params.ops;
  const unknown = ops.find((op) => !["rotary_2d", "window_order", "interpolated_positions"].includes(op));
  if (unknown) throw new NativeImageError(`this vlmrt has no vision input op '${unknown}'; upgrade vlmrt`);
  if (n > rows || n % unit || pixels.length !== n * rowLen) throw new NativeImageError(`${n} patches of a ${gh}x${gw} grid do not fit a vision graph of ${rows} rows`);
  const hd = params.head_dim, value = Math.fround(params.mask_value);
  let [cos, sin] = rotary2d(gh, gw, merge, hd, params.theta);
  let patches = pixels, order = null;
  const feeds = {};
  if (ops.includes("interpolated_positions")) {
    const [index, weight] = interpolatedPositions(gh, gw, merge, params.position_side);
    const pi = new BigInt64Array(rows * 4), pw = new Float32Array(rows * 4);
    pi.set(index);
    pw.set(weight);
    feeds.pos_index = ["int64", pi, [rows, 4]];
    feeds.pos_weight = ["float32", pw, [rows, 4]];
  }
  if (ops.includes("window_order")) {
    const [blocks, wins] = windowOrder(gh, gw, merge, params.window, params.patch);
    order = blocks;
    const permute = (x, len) => {
      const y = new Float32Array(x.length);
      blocks.forEach((b, i) => y.set(x.subarray(b * unit * len, (b + 1) * unit * len), i * unit * len));
      return y;
    };
    patches = permute(patches, rowLen);
    cos = permute(cos, hd);
    sin = permute(sin, hd);
    feeds.full_mask = ["float32", segmentMask(new Float64Array(n), rows, value), [rows, rows]];
    feeds.window_mask = ["float32", segmentMask(wins.flatMap((w) => Array(unit).fill(w)), rows, value), [rows, rows]];
  } else {
    feeds.attention_mask = ["float32", segmentMask(new Float64Array(n), rows, value), [rows, rows]];
  }
  const padded = (x, len, fill) => {
    const y = new Float32Array(rows * len).fill(fill);
    y.set(x);
    return y;
  };
  feeds.patches = ["float32", padded(patches, rowLen, 0), [rows, rowLen]];
  feeds.rotary_cos = ["float32", padded(cos, hd, 1), [rows, hd]];
  feeds.rotary_sin = ["float32", padded(sin, hd, 0), [rows, hd]];
  return { feeds, tokens: n / unit, order };
}

// tile_inputs.encode_tiles for a native-resolution image ({pixels, patchGrid} of smartResizeImage): the vision graph
// once, its tokens put back in raster order; {embeds [tokens * hidden], rows [tokens * width] | null}: with row
// outputs (manifest vision.row_outputs, Qwen3-VL's DeepStack features) their rows side by side, the decoder's row input
export async function encodeNative(ort, session, m, im) {
  const v = m.vision, g = m.graphs.vision, names = { patches: v.patches_input, ...v.extra_inputs };
  const input = g.inputs.find((t) => t.name === v.patches_input);
  const f = nativeGridFeeds(im.pixels, im.patchGrid, v.params, input.shape[0], input.shape[1]);
  const feeds = {};
  for (const [role, [type, data, dims]] of Object.entries(f.feeds)) feeds[names[role]] = new ort.Tensor(type, data, dims);
  const outs = await session.run(feeds, [v.embeds_output, ...v.row_outputs]);
  const take = (t) => {  // the first `tokens` rows, back in raster order (VisionFeeds.restore)
    const dim = t.dims[t.dims.length - 1], x = t.data, y = new Float32Array(f.tokens * dim);
    for (let i = 0; i < f.tokens; i++) y.set(x.subarray(i * dim, (i + 1) * dim), (f.order ? f.order[i] : i) * dim);
    return [y, dim];
  };
  const [embeds] = take(outs[v.embeds_output]);
  if (!v.row_outputs.length) return { embeds, rows: null };
  const parts = v.row_outputs.map((name) => take(outs[name])), width = parts.reduce((a, [, d]) => a + d, 0);
  const rows = new Float32Array(f.tokens * width);
  for (let i = 0; i < f.tokens; i++) {
    let at = i * width;
    for (const [y, d] of parts) { rows.set(y.subarray(i * d, (i + 1) * d), at); at += d; }
  }
  return { embeds, rows };
}

// vision.tile_inputs -> (ort, vision session, manifest, preprocessed image) -> {embeds, rows}
export const NATIVE_TILE_INPUTS = { native_grid: encodeNative };
