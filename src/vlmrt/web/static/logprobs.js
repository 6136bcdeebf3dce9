// Log probabilities of the chosen tokens, as runtime/decode/logprobs.py: log_softmax of the logits row the token was
// picked from, as the decoder graph returns it (before temperature, top-k and top-p), and the `top` most likely ids of
// the same row, best first (ties by the lower id). Computed in float64 (the Python runtime: float32 sums).

export const MAX_TOP = 20;  // OpenAI's limit on top_logprobs

export function checkLogprobs(n) {
  if (n !== null && !(Number.isInteger(n) && n >= 0 && n <= MAX_TOP)) {
    throw new RangeError(`logprobs must be null or an integer from 0 to ${MAX_TOP} (the top tokens to list beside each token), not ${n}`);
  }
}

// row: one logits row (Float32Array [vocab]); token: the id picked from it -> {id, logprob, top: [{id, logprob}]}
export function tokenLogprob(row, token, top) {
  const n = row.length;
  let m = -Infinity;
  for (let i = 0; i < n; i++) if (row[i] > m) m = row[i];
  let s = 0;
  for (let i = 0; i < n; i++) s += Math.exp(row[i] - m);
  const lse = m + Math.log(s);
  const best = [];  // [id, value], best first; an equal value goes after the earlier (lower) id
  for (let i = 0; i < n && top > 0; i++) {
    const v = row[i];
    if (best.length === top && v <= best[top - 1][1]) continue;
    let at = best.length;
    while (at > 0 && best[at - 1][1] < v) at--;
    best.splice(at, 0, [i, v]);
    if (best.length > top) best.pop();
  }
  return { id: token, logprob: row[token] - lse, top: best.map(([id, v]) => ({ id, logprob: v - lse })) };
}
