// Rope positions, as runtime/prompt/positions.py + mrope.py: the manifest's named positions op (decoder.positions.op)
// turns a prompt (its length and its images' token slots and grids) into positions [rows, n], row-major int64; a
// generated token is one past the largest position of the last slot, in every row (KVCache.next_position).
//   slots  position p at slot p, in every row
//   mrope  3 rows (t, h, w), Qwen2-VL's get_rope_index: text takes the running position in every row; an image's
//          tokens (one run of slots, its rows × cols token grid in raster order) take (p, p + row, p + col) and the
//          tokens after it continue at p + max(rows, cols)

export class PositionsError extends Error {}

// images: [{slots: [slot of each image token, in order], rows, cols}] in prompt order
function slots(rows, n, images) {
  const out = new BigInt64Array(rows * n);
  for (let r = 0; r < rows; r++) for (let i = 0; i < n; i++) out[r * n + i] = BigInt(i);
  return out;
}

function mrope(rows, n, images) {
  if (rows !== 3) throw new PositionsError(`the mrope positions op gives 3 rows, the bundle's decoder takes ${rows}`);
  const t = new Float64Array(n), h = new Float64Array(n), w = new Float64Array(n);  // (integers; BigInt at the end)
  let pos = 0, at = 0;
  const text = (end) => { for (; at < end; at++, pos++) t[at] = h[at] = w[at] = pos; };
  for (const im of images) {
    const a = im.slots[0], b = a + im.slots.length;
    if (im.slots[im.slots.length - 1] !== b - 1) throw new PositionsError("an image's tokens are not one run: M-RoPE positions an image's tokens as a grid");
    if (im.slots.length !== im.rows * im.cols) throw new PositionsError(`an image of ${im.rows}x${im.cols} tokens has ${im.slots.length} image tokens in the prompt`);
    text(a);
    for (let k = 0; k < b - a; k++) {
      t[a + k] = pos;
      h[a + k] = pos + Math.floor(k / im.cols);
      w[a + k] = pos + (k % im.cols);
    }
    pos += Math.max(im.rows, im.cols);
    at = b;
  }
  text(n);
  const out = new BigInt64Array(3 * n);
  [t, h, w].forEach((row, r) => row.forEach((x, i) => { out[r * n + i] = BigInt(x); }));
  return out;
}

export const POSITION_OPS = { slots, mrope };

// The positions op's problem with a bundle (null: this runtime has it)
export function positionsProblem(op) {
  return POSITION_OPS[op] ? null : `this vlmrt has no positions op '${op}'; upgrade vlmrt`;
}

// [rows * n] int64 positions of a prompt of n tokens (from slot 0)
export function promptPositions(op, rows, n, images) {
  return POSITION_OPS[op](rows, n, images);
}

// A step's positions [rows * ar]: the given ones of its n rows (row-major [rows * n]), or, none given, each row one
// past the last (`next`: KVCache.next_position), and a static graph's padding rows continuing from the last
// (step.load: positions[:, -1] + 1, 2, ...)
export function stepPositions(given, rows, n, ar, next) {
  const out = new BigInt64Array(rows * ar);
  for (let r = 0; r < rows; r++) {
    let last = BigInt(next) - 1n;
    for (let i = 0; i < ar; i++) {
      last = given && i < n ? given[r * n + i] : last + 1n;
      out[r * ar + i] = last;
    }
  }
  return out;
}

// The position after a step's n kept rows (positions [rows * ar]): one past the largest of its last row's
export function positionAfter(positions, rows, n, ar) {
  let top = positions[n - 1];
  for (let r = 1; r < rows; r++) if (positions[r * ar + n - 1] > top) top = positions[r * ar + n - 1];
  return Number(top) + 1;
}
