// The decoder graphs and the KV cache, as runtime/engine.py + step.py + kv_cache.py execute them: the one place that
// knows the manifest's decoder kinds. A step takes the embeddings of n tokens at the cache's next positions and
// returns the last row's logits (and the graph's argmax of it, where the graph has one).
//
// Kinds (the manifest's kv.layout and decoder fields):
//   in_place  the CPU target's GroupQueryAttention decoder: buffers [1, heads, max_context, head_dim] per layer and
//             K/V that the graph updates itself. ORT's CPU EP binds present_* to the past_* memory; onnxruntime-web
//             cannot, so each step's present_* tensors are the next step's past_* (copied in and out of WASM memory).
//   rows      graphs that return only the step's new K/V rows [ar, dim] (--attention portable, static graphs): the
//             host cache [max_context, dim] per layer and K/V, read as the prefix [:ctx] (context_step) or whole,
//             with positions and an additive mask [ar, ctx + ar]; static graphs (no dynamic_ar) take a fixed AR and
//             the last prompt block padded, its padded rows dropped.

// What this browser runtime cannot run exactly, as one line naming what to export instead; null when it can.
export function browserProblem(m) {
  const reexport = "re-export it for the browser: vlmrt export CHECKPOINT OUT (the CPU target, --dtype fp32, --quant fp32, w8a16 or w4a16)";
  if ((m.target?.name ?? "cpu") !== "cpu") return `this bundle is for the ${m.target.name} target, which a browser cannot run; ${reexport}`;
  for (const [name, g] of Object.entries(m.graphs)) {
    if (!g.file) return `graph ${name} has no ONNX file (only a compiled context); ${reexport}`;
    if (/a8/.test(g.precision) || /a8/.test(String(g.weights?.lm_head ?? ""))) {
      return `graph ${name} is ${g.precision}${/a8/.test(g.precision) ? "" : ` (lm head ${g.weights.lm_head})`}: onnxruntime-web computes int8-activation MatMulNBits in float, so its answers would not be vlmrt run's; ${reexport}`;
    }
    for (const t of [...g.inputs, ...g.outputs]) {
      if (t.dtype === "float16") return `graph ${name} has float16 I/O (${t.name}), which this browser runtime does not feed; re-export with --dtype fp32 (weights may stay fp16 / 8 / 4 bit: --quant)`;
    }
  }
  if (m.kv.dtype !== "float32" || Object.keys(m.kv.encodings || {}).length) return `this bundle's KV cache is ${m.kv.dtype} (quantized); ${reexport}`;
  const d = m.decoder;
  if (d.hidden_output) return `this bundle's lm head is its own graph (an NPU export); ${reexport}`;
  if (!["in_place", "rows"].includes(m.kv.layout)) return `this vlmrt has no KV layout '${m.kv.layout}'; upgrade vlmrt`;
  if (m.kv.layout === "in_place" && !d.dynamic_ar) return "an in_place KV cache needs a decoder that takes any AR; re-export it";
  return null;
}

const F32_LOWEST = -3.4028234663852886e38;

export class Decoder {
  // sessions: {prefill, decode} (ort.InferenceSession; the same one when both name one file)
  constructor(ort, manifest, sessions) {
    this.ort = ort;
    this.m = manifest;
    this.d = manifest.decoder;
    this.kv = manifest.kv;
    this.sessions = sessions;
    this.inPlace = this.kv.layout === "in_place";
    this.length = 0;  // slots holding rows (= the next position)
    this.runMs = 0;  // time inside session.run, accumulated
    this.zeros = new Map();  // ar -> zero token rows / scales (int8 tables: the host multiplies, see embed)
    this.reset();
  }

  reset() {
    const kv = this.kv, T = this.ort.Tensor;
    this.length = 0;
    if (this.inPlace) {
      const shape = [1, kv.heads, kv.max_context, kv.head_dim], n = shape.reduce((a, b) => a * b, 1);
      const zero = new Float32Array(n);  // one zero buffer: a step returns new tensors, never writes its inputs
      this.past = [];
      for (let i = 0; i < kv.layers; i++) this.past.push([new T("float32", zero, shape), new T("float32", zero, shape)]);
    } else {
      this.cache = [];
      for (let i = 0; i < kv.layers; i++) this.cache.push([new Float32Array(kv.max_context * kv.dim), new Float32Array(kv.max_context * kv.dim)]);
    }
  }

  // tokens per prompt step in a mode: prefill_ar for hybrid, 1 for kv (Engine._blocks)
  blocks(mode) {
    return mode === "hybrid" ? this.d.prefill_ar : 1;
  }

  // the cache prefix a step at first position pos reads (Engine._ctx, kv_cache.context_slots)
  ctx(pos) {
    const step = this.d.context_step, top = this.kv.max_context;
    return step ? Math.min(top, Math.max(step, Math.ceil(pos / step) * step)) : top;
  }

  // embeds: Float32Array [n * hidden] at positions length..length+n-1; kind "prefill" | "decode" (graph choice)
  async step(kind, embeds, n) {
    const d = this.d, kv = this.kv, T = this.ort.Tensor, hidden = d.hidden_size, pos = this.length;
    if (pos + n > kv.max_context) throw new Error(`the cache holds ${kv.max_context} positions; a step at ${pos} of ${n} tokens does not fit`);
    const ar = d.dynamic_ar ? n : (kind === "prefill" ? d.prefill_ar : 1);
    const session = this.sessions[kind];
    let x = embeds;
    if (ar > n) {  // a static graph's padded last block: computed, never written to the cache
      x = new Float32Array(ar * hidden);
      x.set(embeds.subarray(0, n * hidden));
    }
    const feeds = { [d.embeds_input]: new T("float32", x, [ar, hidden]) };
    if (d.token_rows_input) {
      if (!this.zeros.has(ar)) this.zeros.set(ar, [new Int8Array(ar * hidden), new Float32Array(ar)]);
      const [rows, scales] = this.zeros.get(ar);
      feeds[d.token_rows_input] = new T("int8", rows, [ar, hidden]);
      feeds[d.token_scales_input] = new T("float32", scales, [ar]);
    }
    // the rows whose logits the step returns: the last valid one (logits_rows: 1 row with logit_rows / last_logits)
    if (d.logit_rows_input) feeds[d.logit_rows_input] = new T("int64", BigInt64Array.from([BigInt(n - 1)]), [1]);
    const fetches = [d.logits_output];
    if (d.argmax_output) fetches.push(d.argmax_output);
    const name = (f, i) => f.replace("{layer}", i);
    let ctx = 0;
    if (this.inPlace) {
      feeds[d.seqlens_input] = new T("int32", Int32Array.from([pos + ar - 1]), [1]);
      feeds[d.total_length_input] = new T("int32", Int32Array.from([pos + ar]), []);
      this.past.forEach(([k, v], i) => {
        feeds[name(kv.key_input, i)] = k;
        feeds[name(kv.value_input, i)] = v;
      });
    } else {
      ctx = this.ctx(pos);
      const positions = new BigInt64Array(ar);
      for (let i = 0; i < ar; i++) positions[i] = BigInt(pos + i);
      feeds[d.positions_input] = new T("int64", positions, [ar]);
      feeds[d.mask_input] = new T("float32", this.mask(pos, ar, ctx), [ar, ctx + ar]);
      this.cache.forEach(([k, v], i) => {
        feeds[name(kv.key_input, i)] = new T("float32", k.subarray(0, ctx * kv.dim), [ctx, kv.dim]);
        feeds[name(kv.value_input, i)] = new T("float32", v.subarray(0, ctx * kv.dim), [ctx, kv.dim]);
      });
    }
    for (let i = 0; i < kv.layers; i++) fetches.push(name(kv.key_output, i), name(kv.value_output, i));
    const t = performance.now();
    const out = await session.run(feeds, fetches);
    this.runMs += performance.now() - t;
    for (let i = 0; i < kv.layers; i++) {
      const k = out[name(kv.key_output, i)], v = out[name(kv.value_output, i)];
      if (this.inPlace) {
        this.past[i][0].dispose?.();
        this.past[i][1].dispose?.();
        this.past[i] = [k, v];  // the updated buffers are the next step's inputs
      } else {  // KVCache.write: the first n rows into slots pos..
        this.cache[i][0].set(k.data.subarray(0, n * kv.dim), pos * kv.dim);
        this.cache[i][1].set(v.data.subarray(0, n * kv.dim), pos * kv.dim);
        k.dispose?.();
        v.dispose?.();
      }
    }
    this.length = pos + n;
    const logits = out[d.logits_output];
    const rows = logits.dims[0], vocab = logits.dims[1];
    const row = d.logit_rows_input || d.last_logits ? rows - 1 : n - 1;  // the last valid token's row
    const result = { logits: logits.data.subarray(row * vocab, (row + 1) * vocab), argmax: null };
    if (d.argmax_output) result.argmax = Number(out[d.argmax_output].data[d.logit_rows_input || d.last_logits ? 0 : row]);
    return result;
  }

  // kv_cache.attention_mask: slots < pos visible, causal within the step, the rest at the mask value
  mask(pos, ar, ctx) {
    const neg = this.d.mask_value ?? F32_LOWEST, w = ctx + ar;
    const m = new Float32Array(ar * w).fill(neg);
    for (let r = 0; r < ar; r++) {
      m.fill(0, r * w, r * w + pos);
      m.fill(0, r * w + ctx, r * w + ctx + r + 1);
    }
    return m;
  }
}
