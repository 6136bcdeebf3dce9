// vlmrt's browser runtime: a bundle's manifest executed as the Python runtime (runtime/vlm.py) executes it —
// tokenizer, chat template, image preprocessing, vision encode, splice, prefill, decode, greedy or sampled
// decoding, stop conditions — on onnxruntime-web's WASM backend, in this tab. Nothing leaves the device: the bundle's
// files come from this site (and then from the browser's cache), images are decoded here.
//
//   const vlm = await VLM.load("bundle/", {threads: 2, onProgress});
//   const r = await vlm.ask({images: ["cat.png"], prompt: "What is this?", maxNewTokens: 64, onText: (s) => ...});
//   r.text, r.tokenIds, r.stats

import { Tokenizer } from "./vendor/tokenizers.min.mjs";
import { Decoder, browserProblem } from "./decoder.js";
import { BundleFiles } from "./files.js";
import { decodeImage, preprocess, unfoldPatches } from "./image.js";
import { NATIVE_TILE_INPUTS } from "./image_native.js";
import { promptPositions } from "./positions.js";
import { openTable } from "./table.js";
import { blockEnd, promptSpans } from "./spans.js";
import { POOLED_TILE_INPUTS } from "./image_pooled.js";
import { ChatTemplate, parseMessages } from "./prompt.js";
import { checkLogprobs, tokenLogprob } from "./logprobs.js";
import { Sampler } from "./sampler.js";
import { StopStrings } from "./stop_strings.js";

export const SCHEMA_VERSION = 3;  // the manifest version this runtime reads (src/vlmrt/format/manifest.py)

export class BundleError extends Error {}

// onnxruntime-web: its WASM build; the WebGPU build where the site has it (vlmrt web --webgpu) and the page asks
// for it (ep "webgpu"), for the experiments docs/browser.md describes
let ort = null;
const ORT_BUILDS = { wasm: "./vendor/ort/ort.wasm.min.mjs", webgpu: "./vendor/ort/ort.webgpu.min.mjs" };

// the graph files a bundle's graphs name, each with its external data files, one session per file
async function createSession(files, graph, providers) {
  const model = await files.get(graph.file);
  const externalData = [];
  for (const f of graph.data_files) externalData.push({ path: f.split("/").pop(), data: await files.get(f) });
  return ort.InferenceSession.create(model, { executionProviders: providers, graphOptimizationLevel: "all", externalData });
}

export class VLM {
  // base: URL of the bundle folder (ending in /). options: threads (WASM threads; they need cross-origin isolation),
  // onProgress({done, total, fromNetwork}) as bytes arrive; table: how the token table reaches the page (table.js:
  // "whole", "ranged" (HTTP Range rows), null: ranged when the file is over 512 MB)
  static async load(base, { threads = null, ep = "wasm", onProgress = () => {}, table = null } = {}) {
    const t0 = performance.now();
    base = new URL(base, document.baseURI).href;
    const r = await fetch(new URL("manifest.json", base), { cache: "no-store" });
    if (!r.ok) throw new BundleError(`no bundle at ${base} (manifest.json: HTTP ${r.status})`);
    const m = await r.json();
    if (m.schema_version !== SCHEMA_VERSION) throw new BundleError(`bundle schema version ${m.schema_version} is not supported (this page reads ${SCHEMA_VERSION}); re-export it`);
    const problem = browserProblem(m);
    if (problem) throw new BundleError(problem);
    if (!ORT_BUILDS[ep]) throw new BundleError(`unknown execution provider '${ep}' (wasm or webgpu)`);
    if (ort && ort.__vlmrtEP !== ep) throw new BundleError("this page already loaded another onnxruntime-web build");
    if (!ort) {
      try {
        ort = { ...(await import(ORT_BUILDS[ep])), __vlmrtEP: ep };
      } catch (e) {
        throw new BundleError(`this site has no onnxruntime-web ${ep} build (vlmrt web --webgpu adds it): ${e.message}`);
      }
    }
    ort.env.wasm.wasmPaths = new URL("./vendor/ort/", import.meta.url).href;
    if (threads) ort.env.wasm.numThreads = threads;
    const files = new BundleFiles(base, m, onProgress);
    const tokenizer = new Tokenizer(JSON.parse(new TextDecoder().decode(await files.get(m.tokenizer_file))), { clean_up_tokenization_spaces: false });
    const rows = await openTable(files, m, table);
    const sessions = {};
    const byFile = new Map();
    for (const name of ["vision", "prefill", "decode"]) {
      const g = m.graphs[name];
      if (!byFile.has(g.file)) byFile.set(g.file, await createSession(files, g, ep === "webgpu" ? ["webgpu", "wasm"] : ["wasm"]));
      sessions[name] = byFile.get(g.file);
    }
    const vlm = new VLM(m, tokenizer, rows, sessions);
    vlm.loadMs = performance.now() - t0;
    vlm.bytes = { total: files.total, fromNetwork: files.fromNetwork };
    vlm.threads = ort.env.wasm.numThreads;
    vlm.ep = ep;
    return vlm;
  }

  constructor(manifest, tokenizer, table, sessions) {
    this.manifest = manifest;
    this.tokenizer = tokenizer;
    this.table = table;  // rows by token id (table.js: whole or ranged)
    this.sessions = sessions;
    this.template = new ChatTemplate(manifest.prompt);
    this.decoder = new Decoder(ort, manifest, { prefill: sessions.prefill, decode: sessions.decode,
      embedsInput: manifest.decoder.embeds_input, logitsOutput: manifest.decoder.logits_output });
    this.busy = false;
  }

  // token rows [n * hidden] float32 (Engine.embed: an int8 row times its scale, a float16 row widened, in float32)
  embed(ids) {
    return this.table.rows(ids);
  }

  // a preprocessed image -> its rows [tokens * hidden]: the vision graph tile by tile ([tiles, 3, S, S] unfolded),
  // or the feeds of a named tile-inputs op (image_pooled.js)
  async encodeImage({ pixels, grid, ...image }) {
    const m = this.manifest, s = m.image.tile_size, p = m.image.patch_size, plane = 3 * s * s, tiles = grid[2];
    const own = POOLED_TILE_INPUTS[m.vision.tile_inputs];
    if (own) {
      const { feeds, tokens } = own(ort, { pixels, grid, ...image }, m);
      const out = await this.sessions.vision.run(feeds, [m.vision.embeds_output]);
      return out[m.vision.embeds_output].data.subarray(0, tokens * m.decoder.hidden_size);
    }
    const parts = [];
    for (let t = 0; t < tiles; t++) {
      const patches = unfoldPatches(pixels, t * plane, s, p);
      const x = new ort.Tensor("float32", patches, [(s / p) ** 2, 3 * p * p]);
      const out = await this.sessions.vision.run({ [m.vision.patches_input]: x }, [m.vision.embeds_output]);
      parts.push(out[m.vision.embeds_output].data);
    }
    const all = new Float32Array(parts.reduce((a, b) => a + b.length, 0));
    let at = 0;
    for (const q of parts) { all.set(q, at); at += q.length; }
    return all;
  }

  // One user turn: the images (URLs, data URIs, Blobs) in order, then the prompt.
  ask({ images = [], prompt, ...options }) {
    if (typeof prompt !== "string") throw new TypeError("ask needs a prompt (a string)");
    const content = [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: prompt }];
    return this.chat([{ role: "user", content }], options);
  }

  // The next assistant turn of OpenAI-style messages (everything computed afresh, as VLM.generate).
  // options: maxNewTokens (256), mode ("hybrid" | "kv"), temperature, topK, topP, seed, stop (strings), ignoreEos,
  // onText(piece) as the answer streams, onToken(id); logprobs: N (0..20) gives the answer's logprobs (logprobs.js:
  // each token's and its row's N most likely, as VLM.generate(logprobs=N)); responseFormat: only {type: "text"}
  // (structured output needs llguidance, a native library: vlmrt run / serve have it, the browser does not)
  async chat(messages, { maxNewTokens = 256, mode = null, temperature = 0, topK = 0, topP = 1, seed = null, stop = null,
    ignoreEos = false, onText = () => {}, onToken = () => {}, responseFormat = null, logprobs = null } = {}) {
    if (responseFormat !== null && !(responseFormat && responseFormat.type === "text")) {
      throw new Error("responseFormat: structured output (JSON schema, grammar) needs llguidance, a native library the browser runtime does not have; use vlmrt run or vlmrt serve");
    }
    checkLogprobs(logprobs);
    if (this.busy) throw new Error("this VLM is answering another request (one at a time: its KV cache is one conversation's)");
    if (!(Number.isInteger(maxNewTokens) && maxNewTokens >= 1)) throw new RangeError("maxNewTokens must be an integer >= 1");
    const m = this.manifest;
    mode = mode || m.generate.default_mode || "hybrid";
    if (!["kv", "hybrid"].includes(mode)) throw new RangeError(`unknown mode '${mode}'; choose one of kv, hybrid`);
    const sampler = new Sampler({ temperature, topK, topP, seed }), cut = new StopStrings(stop);
    this.busy = true;
    try {
      return await this.answer(parseMessages(messages), mode, maxNewTokens, sampler, cut, ignoreEos, onText, onToken,
        logprobs);
    } finally {
      this.busy = false;
    }
  }

  async answer(conv, mode, maxNewTokens, sampler, cut, ignoreEos, onText, onToken, logprobs = null) {
    const m = this.manifest, st = { mode, threads: this.threads, loadMs: this.loadMs };
    const t0 = performance.now();
    const images = [];
    for (const src of conv.images) images.push(preprocess(await decodeImage(src), m.image));
    const grids = images.map((x) => (x.tileTokens ? [...x.grid, x.tileTokens] : x.grid));
    const text = this.template.render(conv, grids);
    const ids = this.tokenizer.encode(text, { add_special_tokens: m.prompt.add_special_tokens }).ids;
    st.promptTokens = ids.length;
    st.imageTiles = grids.reduce((a, g) => a + g[2], 0);
    if (ids.length >= m.kv.max_context) {
      throw new RangeError(`${images.length ? "image + prompt" : "prompt"} is ${ids.length} tokens but the bundle's max context is ${m.kv.max_context}; re-export with a larger --max-seq-len`);
    }
    const t1 = performance.now();
    st.preprocessMs = t1 - t0;
    // splice: the image-token rows, in order, are the vision graph's (a ranged table's row requests go out before
    // the images are encoded, and arrive meanwhile); a decoder with a row input (decoder.row_input) gets the vision
    // graph's row outputs at the image rows
    const h = m.decoder.hidden_size, tokenRows = this.embed(ids);
    tokenRows.catch(() => {});  // (awaited below; a vision error first must not leave it unhandled)
    const encoded = [];
    const native = NATIVE_TILE_INPUTS[m.vision.tile_inputs];  // (image_native.js; else encodeImage)
    for (const im of images) {
      encoded.push(native ? await native(ort, this.sessions.vision, m, im) : { embeds: await this.encodeImage(im), rows: null });
    }
    const embeds = await tokenRows;
    const width = m.decoder.row_input?.width ?? 0, rowInput = width ? new Float32Array(ids.length * width) : null;
    const slots = [], placed = [];  // placed: each image's slots and token grid (the positions op's)
    ids.forEach((id, i) => { if (id === m.special_tokens.image_token_id) slots.push(i); });
    let at = 0;
    for (const [i, enc] of encoded.entries()) {
      const rows = enc.embeds, count = rows.length / h;
      placed.push({ slots: slots.slice(at, at + count), rows: images[i].grid[0], cols: images[i].grid[1] });
      for (let r = 0; r < count; r++) {
        if (at >= slots.length) throw new Error("the image gives more embeddings than the prompt has image tokens");
        embeds.set(rows.subarray(r * h, (r + 1) * h), slots[at] * h);
        if (enc.rows) rowInput.set(enc.rows.subarray(r * width, (r + 1) * width), slots[at] * width);
        at++;
      }
    }
    if (at !== slots.length) throw new Error(`prompt has ${slots.length} image tokens but the images give ${at} embeddings`);
    const t2 = performance.now();
    st.visionMs = t2 - t1;

    // prefill (Engine.prefill): blocks of prefill_ar tokens (hybrid) or one token at a time (kv); a decoder with a
    // span input gets each block's image spans, and no block ends inside an image (spans.js)
    const dec = this.decoder, ar = dec.blocks(mode), n = ids.length;
    const spans = m.decoder.span_input ? promptSpans(ids.map((id) => id === m.special_tokens.image_token_id)) : null;
    const R = m.decoder.positions.rows, positions = promptPositions(m.decoder.positions.op, R, n, placed);
    dec.reset();
    dec.runMs = 0;
    let out;
    for (let b = 0, e; b < n; b = e) {
      e = blockEnd(spans, b, ar, n);
      const k = e - b, pos = new BigInt64Array(R * k);
      for (let r = 0; r < R; r++) pos.set(positions.subarray(r * n + b, r * n + e), r * k);
      out = await dec.step(ar > 1 ? "prefill" : "decode", embeds.subarray(b * h, e * h), k,
        { positions: pos, rows: rowInput && rowInput.subarray(b * width, e * width), spans: spans?.subarray(b, e) });
    }
    let row;  // the logits row the token was picked from (for its logprobs)
    const pick = (o) => { row = o.logits; return sampler.greedy && o.argmax !== null ? o.argmax : sampler.pick(o.logits); };
    let token = pick(out);
    const t3 = performance.now();
    st.prefillMs = t3 - t2;
    st.ttftMs = t3 - t0;

    // decode (Engine.generate): EOS is not emitted; stop at max_new_tokens, a full cache or a stop string
    const eos = new Set(m.special_tokens.eos_token_ids), tokenIds = [], entries = logprobs === null ? null : [];
    const spelled = (e) => ({ ...e, token: this.tokenizer.decode([e.id], { skip_special_tokens: false }) });
    let shown = "", stopReason = "";
    for (;;) {
      if (eos.has(token) && !ignoreEos) { stopReason = "eos"; break; }
      tokenIds.push(token);
      if (entries) {  // (row: a view of the step's output, read before the next step)
        const e = tokenLogprob(row, token, logprobs);
        entries.push({ ...spelled(e), top: e.top.map(spelled) });
      }
      onToken(token);
      const full = this.tokenizer.decode(tokenIds, { skip_special_tokens: true });
      if (full.length > shown.length && full.startsWith(shown) && !full.endsWith("\uFFFD")) {  // (held: a partial UTF-8 char)
        const piece = cut.feed(full.slice(shown.length));
        shown = full;
        if (piece) onText(piece);
        if (cut.stopped) { stopReason = "stop"; break; }
      }
      if (tokenIds.length >= maxNewTokens) { stopReason = "length"; break; }
      if (dec.length >= m.kv.max_context) { stopReason = "context"; break; }
      token = pick(await dec.step("decode", await this.embed([token]), 1));
    }
    const t4 = performance.now();
    const full = this.tokenizer.decode(tokenIds, { skip_special_tokens: true });
    if (!cut.stopped && full.startsWith(shown) && full.length > shown.length) {
      const piece = cut.feed(full.slice(shown.length));
      if (piece) onText(piece);
    }
    const rest = cut.flush();
    if (rest) onText(rest);
    st.generatedTokens = tokenIds.length;
    st.stopReason = stopReason;
    st.decodeMs = t4 - t3;
    st.decodeTokensPerS = tokenIds.length > 1 ? (tokenIds.length - 1) / ((t4 - t3) / 1000) : 0;
    st.prefillTokensPerS = n / (st.prefillMs / 1000);
    st.runMs = dec.runMs;
    st.totalMs = t4 - t0;
    return { text: cut.stopped || full.startsWith(shown) ? cut.text : full, tokenIds, promptIds: ids, stats: st,
      ...(entries ? { logprobs: entries } : {}) };
  }
}
