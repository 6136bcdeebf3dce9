// Next-token choice from logits, as runtime/decode/sampler.py: greedy (the first of equal maxima, as np.argmax), or
// temperature / top-k / top-p sampling. Sampled answers draw from their own seeded generator (not numpy's), so
// they are sampled the same way as the Python runtime's but are not its token ids; greedy answers are.

export function argmax(logits) {
  let best = 0, v = logits[0];
  for (let i = 1; i < logits.length; i++) if (logits[i] > v) { v = logits[i]; best = i; }
  return best;
}

// mulberry32: a small seeded generator of floats in [0, 1)
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export function checkSampling({ temperature = 0, topK = 0, topP = 1, seed = null } = {}) {
  if (!(Number.isFinite(temperature) && temperature >= 0)) throw new RangeError(`temperature must be a finite number >= 0, not ${temperature}`);
  if (!(Number.isInteger(topK) && topK >= 0)) throw new RangeError("topK must be an integer >= 0");
  if (!(topP > 0 && topP <= 1)) throw new RangeError("topP must be in (0, 1]");
  if (seed !== null && !(Number.isInteger(seed) && seed >= 0)) throw new RangeError(`seed must be an integer >= 0, not ${seed}`);
}

export class Sampler {
  constructor({ temperature = 0, topK = 0, topP = 1, seed = null } = {}) {
    checkSampling({ temperature, topK, topP, seed });
    this.temperature = temperature;
    this.topK = topK;
    this.topP = topP;
    this.random = temperature > 0 ? rng(seed ?? Math.floor(Math.random() * 2 ** 32)) : null;
  }

  get greedy() {
    return this.temperature === 0;
  }

  pick(logits) {
    if (this.greedy) return argmax(logits);
    const n = logits.length, x = new Float64Array(n);
    for (let i = 0; i < n; i++) x[i] = logits[i] / this.temperature;
    if (this.topK && this.topK < n) {
      const kth = Float64Array.from(x).sort()[n - this.topK];
      for (let i = 0; i < n; i++) if (x[i] < kth) x[i] = -Infinity;
    }
    let max = -Infinity;
    for (let i = 0; i < n; i++) if (x[i] > max) max = x[i];
    let sum = 0;
    for (let i = 0; i < n; i++) { x[i] = Math.exp(x[i] - max); sum += x[i]; }
    for (let i = 0; i < n; i++) x[i] /= sum;
    if (this.topP < 1) {
      const order = Array.from(x.keys()).sort((a, b) => x[b] - x[a] || a - b);
      let cum = 0, kept = 0;
      const keep = new Uint8Array(n);
      for (const i of order) {
        if (cum >= this.topP) break;  // the smallest set whose mass reaches top_p (always >= 1 token)
        keep[i] = 1;
        cum += x[i];
        kept += x[i];
      }
      for (let i = 0; i < n; i++) x[i] = keep[i] ? x[i] / kept : 0;
    }
    let r = this.random(), acc = 0;
    for (let i = 0; i < n; i++) {
      acc += x[i];
      if (r < acc) return i;
    }
    for (let i = n - 1; i >= 0; i--) if (x[i] > 0) return i;
    return 0;
  }
}
