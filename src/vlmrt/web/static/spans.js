// Prompt blocks that never split an image span, as runtime/decode/spans.py (manifest decoder.span_input: the rows of
// one image see each other both ways on some layers, Gemma 4's bidirectional vision attention; the graph opens a
// span's later rows only inside a step, so a step holds the rest of every span it starts).
//
//   const spans = promptSpans(isImage);   // BigInt64Array [n]: each row's span (a run of image rows), -1 elsewhere
//   const e = blockEnd(spans, b, ar, n);  // where the prompt block from row b ends

// [n] booleans (an image-token row) -> each maximal run of image rows numbered from 0, -1 elsewhere
export function promptSpans(isImage) {
  const out = new BigInt64Array(isImage.length);
  let span = -1;
  isImage.forEach((img, i) => {
    if (img && !(i > 0 && isImage[i - 1])) span++;
    out[i] = img ? BigInt(span) : -1n;
  });
  return out;
}

// b + ar (at most n), unless that cuts a span: then before the span where it starts inside the block, else (the
// block starts in it: a span longer than ar) at the span's end; spans null: b + ar
export function blockEnd(spans, b, ar, n) {
  let e = Math.min(n, b + ar);
  if (spans === null || e >= n || spans[e] < 0n || spans[e] !== spans[e - 1]) return e;
  const span = spans[e];
  let s = e;
  while (s > b && spans[s - 1] === span) s--;
  if (s > b) return s;
  while (e < n && spans[e] === span) e++;
  return e;
}

// a step's span input [ar]: the block's spans, -1 for rows past them (decode steps, a static graph's padding)
export function spanFeed(spans, ar) {
  const x = new BigInt64Array(ar).fill(-1n);
  if (spans) x.set(spans.subarray(0, Math.min(ar, spans.length)));
  return x;
}
