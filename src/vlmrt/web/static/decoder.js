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

import { WINDOWED_LAYERS, slotLayers } from "./windowed.js";
import { spanFeed } from "./spans.js";
import { positionAfter, positionsProblem, stepPositions } from "./positions.js";
import { recurrentLayers, RecurrentState } from "./recurrent.js";

// The manifest's decoder as one plain description (the only reader of the manifest's decoder and kv fields):
//   {kind: "gqa_in_place" | "rows_dynamic" | "rows_static", dynamicAR, contextStep, maskInput, maskValue,
//    positionsInput, logitRowsInput, lastLogits, argmaxOutput, seqlensInput, totalLengthInput, tokenRowsInput,
//    tokenScalesInput, hiddenOutput, spanInput, validRowsInput, rowInput, rowWidth, layers: [{kind: "attention" |
//    "sliding_attention" | "windowed_attention", kvHeads, headDim, capacity (windowed: the buffer's rows, else null),
//    keyInput, valueInput, keyOutput, valueOutput}] (the layers with buffers:
//    windowed.js), recurrent: [recurrent.js recurrentLayers], otherLayers: [kinds]}
export function decoderPlan(m) {
  const d = m.decoder, kv = m.kv;
  const k = d.kind;
  return {
    kind: k.name, dynamicAR: k.name !== "rows_static", contextStep: k.context_step ?? 0,
    maskInput: k.mask_input ?? null, maskValue: k.mask_value ?? null, positionsInput: d.positions.input,
    positionRows: d.positions.rows, positionsOp: d.positions.op, logitRowsInput: k.logit_rows_input ?? null,
    lastLogits: false, argmaxOutput: k.argmax_output ?? null, seqlensInput: k.seqlens_input ?? null,
    totalLengthInput: k.total_length_input ?? null, tokenRowsInput: k.token_rows_input ?? null,
    tokenScalesInput: k.token_scales_input ?? null, hiddenOutput: k.hidden_output ?? null, spanInput: d.span_input ?? null,
    validRowsInput: k.valid_rows_input ?? null, rowInput: d.row_input?.input ?? null, rowWidth: d.row_input?.width ?? 0,
    recurrent: recurrentLayers(kv),
    layers: slotLayers(kv.layers).map((l) => ({ kind: l.kind, kvHeads: l.kv_heads, headDim: l.head_dim,
      capacity: l.capacity ?? null, keyInput: l.key_input, valueInput: l.value_input, keyOutput: l.key_output,
      valueOutput: l.value_output })),
    otherLayers: kv.layers.map((l) => l.kind).filter((kind) => kind !== "attention" && kind !== "recurrent" && !(kind in WINDOWED_LAYERS)),
  };
}

// What this browser runtime cannot run exactly, as one line naming what to export instead; null when it can.
// (site.py browser_problem refuses the same bundles before a site is written.)
export function browserProblem(m) {
  const reexport = "re-export it for the browser: vlmrt export CHECKPOINT OUT (the CPU target, --dtype fp32, --quant fp32, w8a16 or w4a16)";
  if ((m.target?.name ?? "cpu") !== "cpu") return `this bundle is for the ${m.target.name} target, which a browser cannot run; ${reexport}`;
  for (const [name, g] of Object.entries(m.graphs)) {
    if (!g.file) return `graph ${name} has no ONNX file (only a compiled context); ${reexport}`;
    const head = String(g.weights?.lm_head ?? "");
    if (g.precision.includes("a8") || head.includes("a8")) {
      return `graph ${name} is ${g.precision.includes("a8") ? g.precision : `${g.precision} (lm head ${head})`}: onnxruntime-web computes int8-activation MatMulNBits in float, so its answers would not be vlmrt run's; ${reexport}`;
    }
    for (const t of [...g.inputs, ...g.outputs]) {
      if (t.dtype === "float16") return `graph ${name} has float16 I/O (${t.name}), which the browser runtime does not feed; re-export it with vlmrt export CHECKPOINT OUT --dtype fp32 (weights may stay fp16, 8 or 4 bit: --quant)`;
    }
  }
  if (m.kv.dtype !== "float32" || Object.keys(m.kv.encodings || {}).length) return `this bundle's KV cache is ${m.kv.dtype} (quantized); ${reexport}`;
  const quant = m.kv.layers.find((l) => l.quant)?.quant;
  if (quant) return `this bundle's KV cache is ${quant.bits === 8 ? "int8" : "uint8"} (${quant.bits}-bit, --kv-cache), which the browser runtime does not keep (it keeps a float cache); ${reexport}, --kv-cache fp32`;
  const p = decoderPlan(m);
  if (!["gqa_in_place", "rows_dynamic", "rows_static"].includes(p.kind)) return `this vlmrt has no decoder kind '${p.kind}'; upgrade vlmrt`;
  if (p.hiddenOutput) return `this bundle's lm head is its own graph (an NPU export); ${reexport}`;
  const positions = positionsProblem(p.positionsOp);
  if (positions) return positions;
  const other = p.otherLayers[0];
  if (other) return `this bundle has ${other} cache layers, which the browser runtime does not keep yet; use vlmrt run`;
  return null;
}

const F32_LOWEST = -3.4028234663852886e38;

export class Decoder {
  // sessions: {prefill, decode} (ort.InferenceSession; the same one when both name one file)
  constructor(ort, manifest, sessions) {
    this.ort = ort;
    this.p = decoderPlan(manifest);
    this.hidden = manifest.decoder.hidden_size;
    this.prefillAR = manifest.decoder.prefill_ar;
    this.maxContext = manifest.kv.max_context;
    this.sessions = sessions;
    this.length = 0;  // slots holding rows (= the next position)
    this.runMs = 0;  // time inside session.run, accumulated
    this.zeros = new Map();  // ar -> zero token rows / scales (int8 tables: the host multiplies, VLM.embed)
    this.recurrent = new RecurrentState(ort, this.p.recurrent, this.p.kind === "gqa_in_place");
    this.reset();
  }

  reset() {
    const T = this.ort.Tensor, top = this.maxContext;
    this.length = 0;
    this.next = 0;  // the rope position after the kept rows (KVCache.next_position)
    this.recurrent.reset();
    if (this.p.kind === "gqa_in_place") {
      // one zero buffer per shape: a step returns new tensors and never writes its inputs
      this.past = this.p.layers.map((l) => {
        const rows = l.capacity ?? top;  // a windowed layer's buffers hold capacity rows (the op evicts)
        const shape = [1, l.kvHeads, rows, l.headDim], zero = new Float32Array(l.kvHeads * rows * l.headDim);
        return [new T("float32", zero, shape), new T("float32", zero, shape)];
      });
    } else {
      this.cache = this.p.layers.map((l) => [new Float32Array(top * l.kvHeads * l.headDim), new Float32Array(top * l.kvHeads * l.headDim)]);
    }
  }

  // tokens per prompt step in a mode: prefill_ar for hybrid, 1 for kv (Engine._blocks)
  blocks(mode) {
    return mode === "hybrid" ? this.prefillAR : 1;
  }

  // the cache prefix a step at first position pos reads (Engine._ctx, kv_cache.context_slots)
  ctx(pos) {
    const step = this.p.contextStep, top = this.maxContext;
    return step ? Math.min(top, Math.max(step, Math.ceil(pos / step) * step)) : top;
  }

  // embeds: Float32Array [n * hidden] at slots length..length+n-1; kind "prefill" | "decode" (the graph); positions:
  // BigInt64Array [rows * n] (positions.js; null: each one past the last); rows: the decoder's row input [n * width]
  // (decoder.row_input; null: zeros); spans: the rows' image spans (BigInt64Array [n]; a decoder with a span input:
  // -1 where not given)
  async step(graph, embeds, n, { positions = null, rows = null, spans = null } = {}) {
    const p = this.p, T = this.ort.Tensor, hidden = this.hidden, pos = this.length;
    if (pos + n > this.maxContext) throw new Error(`the cache holds ${this.maxContext} positions; a step at ${pos} of ${n} tokens does not fit`);
    const ar = p.dynamicAR ? n : (graph === "prefill" ? this.prefillAR : 1);
    let x = embeds;
    if (ar > n) {  // a static graph's padded last block: computed, never written to the cache
      x = new Float32Array(ar * hidden);
      x.set(embeds.subarray(0, n * hidden));
    }
    const feeds = { [this.sessions.embedsInput]: new T("float32", x, [ar, hidden]) };
    if (p.tokenRowsInput) {
      if (!this.zeros.has(ar)) this.zeros.set(ar, [new Int8Array(ar * hidden), new Float32Array(ar)]);
      const [rows, scales] = this.zeros.get(ar);
      feeds[p.tokenRowsInput] = new T("int8", rows, [ar, hidden]);
      feeds[p.tokenScalesInput] = new T("float32", scales, [ar]);
    }
    // the rows whose logits the step returns: the last valid one (step.logits_rows: 1 row with logit_rows)
    if (p.logitRowsInput) feeds[p.logitRowsInput] = new T("int64", BigInt64Array.from([BigInt(n - 1)]), [1]);
    const fetches = [this.sessions.logitsOutput];
    if (p.argmaxOutput) fetches.push(p.argmaxOutput);
    const at = stepPositions(positions, p.positionRows, n, ar, this.next);
    feeds[p.positionsInput] = new T("int64", at, [p.positionRows, ar]);  // every kind: [rows, ar]
    if (p.spanInput) feeds[p.spanInput] = new T("int64", spanFeed(spans, ar), [ar]);
    this.stepInputs(feeds, fetches, n, ar, rows);
    if (p.kind === "gqa_in_place") {
      feeds[p.seqlensInput] = new T("int32", Int32Array.from([pos + ar - 1]), [1]);
      feeds[p.totalLengthInput] = new T("int32", Int32Array.from([pos + ar]), []);
      p.layers.forEach((l, i) => {
        feeds[l.keyInput] = this.past[i][0];
        feeds[l.valueInput] = this.past[i][1];
      });
    } else {
      const ctx = this.ctx(pos);
      feeds[p.maskInput] = new T("float32", this.mask(pos, ar, ctx), [ar, ctx + ar]);
      p.layers.forEach((l, i) => {
        const dim = l.kvHeads * l.headDim;
        feeds[l.keyInput] = new T("float32", this.cache[i][0].subarray(0, ctx * dim), [ctx, dim]);
        feeds[l.valueInput] = new T("float32", this.cache[i][1].subarray(0, ctx * dim), [ctx, dim]);
      });
    }
    for (const l of p.layers) fetches.push(l.keyOutput, l.valueOutput);
    const t = performance.now();
    const out = await this.sessions[graph].run(feeds, fetches);
    this.runMs += performance.now() - t;
    p.layers.forEach((l, i) => {
      const k = out[l.keyOutput], v = out[l.valueOutput];
      if (p.kind === "gqa_in_place") {
        this.past[i][0].dispose?.();
        this.past[i][1].dispose?.();
        this.past[i] = [k, v];  // the updated buffers are the next step's inputs
      } else {  // KVCache.write: the first n rows into slots pos..
        const dim = l.kvHeads * l.headDim;
        this.cache[i][0].set(k.data.subarray(0, n * dim), pos * dim);
        this.cache[i][1].set(v.data.subarray(0, n * dim), pos * dim);
      }
    });
    this.recurrent.take(out);
    this.length = pos + n;
    this.next = positionAfter(at, p.positionRows, n, ar);
    const logits = out[this.sessions.logitsOutput];
    const vocab = logits.dims[1];
    const row = p.logitRowsInput || p.lastLogits ? logits.dims[0] - 1 : n - 1;  // the last valid token's row
    const result = { logits: logits.data.subarray(row * vocab, (row + 1) * vocab), argmax: null };
    if (p.argmaxOutput) result.argmax = Number(out[p.argmaxOutput].data[row]);
    return result;
  }

  // the inputs beside the cache's that some decoders take: the recurrent state (recurrent.js), the row input
  // (decoder.row_input: zeros but for image rows) and a static graph's valid rows (1 for the step's n rows)
  stepInputs(feeds, fetches, n, ar, rows) {
    const p = this.p, T = this.ort.Tensor;
    this.recurrent.feed(feeds);
    fetches.push(...this.recurrent.fetches());
    if (p.rowInput) {
      const x = new Float32Array(ar * p.rowWidth);
      if (rows) x.set(rows.subarray(0, n * p.rowWidth));
      feeds[p.rowInput] = new T("float32", x, [ar, p.rowWidth]);
    }
    if (p.validRowsInput) feeds[p.validRowsInput] = new T("float32", new Float32Array(ar).fill(1, 0, n), [ar]);
  }

  // kv_cache.attention_mask: slots < pos visible, causal within the step, the rest at the mask value
  mask(pos, ar, ctx) {
    const neg = this.p.maskValue ?? F32_LOWEST, w = ctx + ar;
    const m = new Float32Array(ar * w).fill(neg);
    for (let r = 0; r < ar; r++) {
      m.fill(0, r * w, r * w + pos);
      m.fill(0, r * w + ctx, r * w + ctx + r + 1);
    }
    return m;
  }
}
