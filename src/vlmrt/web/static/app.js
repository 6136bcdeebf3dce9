// The chat page: loads the bundle (progress in bytes), answers in this tab, streams the answer, shows tokens/s.
// window.vlmrt: {ready (a promise of the VLM), ask({images, prompt, maxNewTokens, ...}) -> {text, tokenIds, ...}}
// for tests and for pages that embed it. URL parameters: bundle=PATH (default bundle/), threads=N, ep=wasm|webgpu
// (webgpu: sites written with vlmrt web --webgpu).

import { VLM } from "./vlmrt.js";
import { clearCache } from "./files.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const mb = (n) => (n / 1e6).toFixed(1);

function status(text, cls = "") {
  $("status").textContent = text;
  $("status").className = cls;
}

const threads = params.has("threads") ? Number(params.get("threads")) : null;
const ready = VLM.load(params.get("bundle") || "bundle/", {
  threads,
  ep: params.get("ep") || "wasm",
  table: params.get("table"),  // whole | ranged (table.js; default: ranged over 512 MB)
  onProgress: ({ done, total, fromNetwork }) => {
    $("progress").max = total;
    $("progress").value = done;
    status(`loading the model: ${mb(done)} of ${mb(total)} MB${fromNetwork < done ? ` (${mb(done - fromNetwork)} MB from the browser's cache)` : ""}`);
  },
});

let messages = [];
let pending = [];  // data URIs of the images chosen for the next question

const asking = { chain: Promise.resolve() };
function ask(request) {
  // one answer at a time: later calls wait for the earlier ones
  const run = asking.chain.then(async () => (await ready).ask(request));
  asking.chain = run.catch(() => {});
  return run;
}
window.vlmrt = { ready, ask, VLM };

function turn(role, text, images = []) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  for (const src of images) {
    const img = document.createElement("img");
    img.src = src;
    div.append(img);
  }
  const span = document.createElement("span");
  span.textContent = (role === "user" ? "You: " : "") + text;
  div.append(span);
  $("log").append(div);
  $("log").scrollTop = $("log").scrollHeight;
  return span;
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

ready.then((vlm) => {
  const m = vlm.manifest;
  $("model").textContent = `· ${m.model.name || m.model.family} (${m.graphs.decode.precision})`;
  status(`ready: ${mb(vlm.bytes.total)} MB in ${(vlm.loadMs / 1000).toFixed(1)} s${vlm.bytes.fromNetwork === 0 ? " from the browser's cache" : ""}; ` +
    `${vlm.ep === "webgpu" ? "WebGPU + " : ""}WASM, ${vlm.threads} thread${vlm.threads === 1 ? "" : "s"}${crossOriginIsolated ? "" : " (not cross-origin isolated: one thread)"}`);
  for (const id of ["prompt", "images", "send", "reset"]) $(id).disabled = false;
  $("prompt").focus();
}, (e) => {
  status(`cannot load the model: ${e.message}`, "error");
  console.error(e);
});

$("images").addEventListener("change", async () => {
  pending = await Promise.all([...$("images").files].map(readAsDataURL));
  $("thumbs").replaceChildren(...pending.map((src) => Object.assign(document.createElement("img"), { src })));
});

$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});

$("reset").addEventListener("click", () => {
  messages = [];
  $("log").replaceChildren();
});

$("forget").addEventListener("click", async () => {
  await clearCache();
  status("the cached model is removed: the next load downloads it again");
});

$("ask").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text) return;
  const vlm = await ready;
  const images = pending;
  pending = [];
  $("images").value = "";
  $("thumbs").replaceChildren();
  $("prompt").value = "";
  $("send").disabled = true;
  turn("user", text, images);
  const content = [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
  messages.push({ role: "user", content });
  const out = turn("assistant", "");
  let tokens = 0, first = 0;
  try {
    const r = await vlm.chat(messages, {
      maxNewTokens: 256,
      onToken: () => {
        tokens += 1;
        if (tokens === 1) first = performance.now();
        else $("rate").textContent = `${((tokens - 1) / ((performance.now() - first) / 1000)).toFixed(1)} tokens/s`;
      },
      onText: (piece) => { out.textContent += piece; },
    });
    messages.push({ role: "assistant", content: r.text });
    const s = r.stats;
    const n = s.generatedTokens;  // (one token: no decode step, so no decode rate)
    $("rate").textContent = `${n} token${n === 1 ? "" : "s"}, first after ${(s.ttftMs / 1000).toFixed(2)} s` +
      (n > 1 ? `, ${s.decodeTokensPerS.toFixed(1)} tokens/s` : "") +
      ` (prompt ${s.promptTokens} tokens, ${s.prefillTokensPerS.toFixed(0)} tokens/s; stop: ${s.stopReason})`;
  } catch (err) {
    messages.pop();
    out.textContent = `error: ${err.message}`;
    out.className = "error";
  } finally {
    $("send").disabled = false;
  }
});
