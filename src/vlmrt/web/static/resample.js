// Pillow's Image.resize for 8-bit RGB images, ported bit for bit (Pillow 13's libImaging/Resample.c): the Python
// runtime resizes with Pillow (runtime/media/image.py), so the browser must compute the same bytes. A separable
// two-pass convolution, horizontal then vertical, with the filter's coefficients per output pixel normalized to sum
// 1 and rounded to fixed point (PRECISION_BITS fractional bits); each pass accumulates in 32-bit integers from a
// rounding half and clips to 0..255. tests/test_web_image.py compares this against Pillow on many sizes.
//
// An image here is {width, height, data: Uint8Array of width*height*3 (RGB, row-major)}.

const PRECISION_BITS = 32 - 8 - 2;

function sinc(x) {
  if (x === 0.0) return 1.0;
  x = x * Math.PI;
  return Math.sin(x) / x;
}

const F054 = Math.fround(0.54);  // Pillow writes the Hamming constants as C floats (0.54f, 0.46f)
const F046 = Math.fround(0.46);

// name -> [filter(x), support], as Pillow's filters (nearest is not a convolution: see resizeNearest)
const FILTERS = {
  box: [(x) => (x > -0.5 && x <= 0.5 ? 1.0 : 0.0), 0.5],
  bilinear: [(x) => { x = Math.abs(x); return x < 1.0 ? 1.0 - x : 0.0; }, 1.0],
  hamming: [(x) => {
    x = Math.abs(x);
    if (x === 0.0) return 1.0;
    if (x >= 1.0) return 0.0;
    x = x * Math.PI;
    return (Math.sin(x) / x) * (F054 + F046 * Math.cos(x));
  }, 1.0],
  bicubic: [(x) => {
    const a = -0.5;
    x = Math.abs(x);
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
  }, 2.0],
  lanczos: [(x) => (-3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0), 3.0],
};

export const RESAMPLE_NAMES = [...Object.keys(FILTERS), "nearest"];

// Pillow's precompute_coeffs + normalize_coeffs_8bpc: for each output pixel the first input pixel, the count of
// input pixels, and ksize fixed-point weights.
function coefficients(inSize, outSize, name) {
  const [filter, support0] = FILTERS[name];
  const scale = inSize / outSize;
  const filterscale = Math.max(scale, 1.0);
  const support = support0 * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const bounds = new Int32Array(outSize * 2);
  const kk = new Int32Array(outSize * ksize);
  const k = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    const ss = 1.0 / filterscale;
    let xmin = Math.trunc(center - support + 0.5);  // C's (int): toward zero
    if (xmin < 0) xmin = 0;
    let xmax = Math.trunc(center + support + 0.5);
    if (xmax > inSize) xmax = inSize;
    xmax -= xmin;
    let ww = 0.0;
    for (let x = 0; x < xmax; x++) {
      const w = filter((x + xmin - center + 0.5) * ss);
      k[x] = w;
      ww += w;
    }
    for (let x = 0; x < xmax; x++) {
      const v = ww !== 0.0 ? k[x] / ww : k[x];
      // (int)(±0.5 + v * 2^PRECISION_BITS), truncated toward zero
      kk[xx * ksize + x] = v < 0 ? Math.trunc(-0.5 + v * (1 << PRECISION_BITS)) : Math.trunc(0.5 + v * (1 << PRECISION_BITS));
    }
    bounds[xx * 2] = xmin;
    bounds[xx * 2 + 1] = xmax;
  }
  return { ksize, bounds, kk };
}

function clip8(v) {
  // Pillow's clip8: the accumulator >> PRECISION_BITS, clamped to 0..255 (Math.floor: an arithmetic shift, also for
  // accumulators past 2^31, which C's 32-bit int would not hold but Pillow's weights never reach)
  const x = Math.floor(v / (1 << PRECISION_BITS));
  return x < 0 ? 0 : x > 255 ? 255 : x;
}

function horizontal(im, outW, rowFirst, rows, c) {
  const out = new Uint8Array(outW * rows * 3);
  const { ksize, bounds, kk } = c;
  const src = im.data, w = im.width;
  const half = 1 << (PRECISION_BITS - 1);
  for (let yy = 0; yy < rows; yy++) {
    const rowBase = (yy + rowFirst) * w * 3;
    for (let xx = 0; xx < outW; xx++) {
      const xmin = bounds[xx * 2], xmax = bounds[xx * 2 + 1], kb = xx * ksize;
      let s0 = half, s1 = half, s2 = half;
      for (let x = 0; x < xmax; x++) {
        const p = rowBase + (x + xmin) * 3, kv = kk[kb + x];
        s0 += src[p] * kv;
        s1 += src[p + 1] * kv;
        s2 += src[p + 2] * kv;
      }
      const o = (yy * outW + xx) * 3;
      out[o] = clip8(s0);
      out[o + 1] = clip8(s1);
      out[o + 2] = clip8(s2);
    }
  }
  return { width: outW, height: rows, data: out };
}

function vertical(im, outH, c, shift) {
  const w = im.width;
  const out = new Uint8Array(w * outH * 3);
  const { ksize, bounds, kk } = c;
  const src = im.data;
  const half = 1 << (PRECISION_BITS - 1);
  for (let yy = 0; yy < outH; yy++) {
    const ymin = bounds[yy * 2] - shift, ymax = bounds[yy * 2 + 1], kb = yy * ksize;
    for (let xx = 0; xx < w; xx++) {
      let s0 = half, s1 = half, s2 = half;
      for (let y = 0; y < ymax; y++) {
        const p = ((y + ymin) * w + xx) * 3, kv = kk[kb + y];
        s0 += src[p] * kv;
        s1 += src[p + 1] * kv;
        s2 += src[p + 2] * kv;
      }
      const o = (yy * w + xx) * 3;
      out[o] = clip8(s0);
      out[o + 1] = clip8(s1);
      out[o + 2] = clip8(s2);
    }
  }
  return { width: w, height: outH, data: out };
}

function resizeNearest(im, outW, outH) {
  // Pillow's NEAREST resize is an affine transform (ImagingScaleAffine): the source coordinate of each output pixel
  // starts at half a step and is accumulated step by step in double precision, then truncated
  const ax = im.width / outW, ay = im.height / outH;
  const xin = new Int32Array(outW);
  for (let x = 0, xo = ax * 0.5; x < outW; x++, xo += ax) xin[x] = Math.min(im.width - 1, Math.trunc(xo));
  const out = new Uint8Array(outW * outH * 3);
  let yo = ay * 0.5;
  for (let y = 0; y < outH; y++, yo += ay) {
    const yi = Math.min(im.height - 1, Math.trunc(yo));
    for (let x = 0; x < outW; x++) {
      const s = (yi * im.width + xin[x]) * 3, o = (y * outW + x) * 3;
      out[o] = im.data[s];
      out[o + 1] = im.data[s + 1];
      out[o + 2] = im.data[s + 2];
    }
  }
  return { width: outW, height: outH, data: out };
}

// im.resize((outW, outH), resample=name) of an RGB image, as Pillow computes it.
export function resize(im, outW, outH, name) {
  if (!RESAMPLE_NAMES.includes(name)) throw new Error(`this vlmrt has no resample filter '${name}'; upgrade vlmrt`);
  if (outW === im.width && outH === im.height) return { width: im.width, height: im.height, data: im.data.slice() };
  if (name === "nearest") return resizeNearest(im, outW, outH);
  const needH = outW !== im.width, needV = outH !== im.height;
  const ch = coefficients(im.width, outW, name);
  const cv = coefficients(im.height, outH, name);
  // Pillow 13 resizes vertically first when the height shrinks by more than twice as many pixels as the width
  // (the passes round to 8 bits in between, so the order shows in the result)
  if (needH && needV && outH < im.height && im.height - outH > 2 * (im.width - outW)) {
    const v = vertical(im, outH, cv, 0);
    return horizontal(v, outW, 0, outH, ch);
  }
  // else horizontally first, only over the rows the vertical pass reads (as Pillow does)
  const first = cv.bounds[0];
  const last = cv.bounds[outH * 2 - 2] + cv.bounds[outH * 2 - 1];
  let cur = im, shift = 0;
  if (needH) {
    cur = horizontal(im, outW, first, last - first, ch);
    shift = first;
  }
  if (needV) return vertical(cur, outH, cv, shift);
  return cur;
}

// im.crop((x0, y0, x0 + w, y0 + h)), inside the image
export function crop(im, x0, y0, w, h) {
  const out = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++) out.set(im.data.subarray(((y0 + y) * im.width + x0) * 3, ((y0 + y) * im.width + x0 + w) * 3), y * w * 3);
  return { width: w, height: h, data: out };
}
