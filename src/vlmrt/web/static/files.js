// The bundle's files, fetched from the site itself (never a CDN, never an API): bytes counted as they arrive
// (load progress), each checked against the manifest's size and sha256, and kept in the browser's Cache Storage
// under its sha256 so that a reload reads them from disk instead of downloading them again.

const CACHE_NAME = "vlmrt-bundle-v1";
// a file is cached in parts of at most this many bytes (one 500 MB entry can fail where its parts do not: each put
// is one copy to the browser's storage)
const PART_BYTES = 64 * 1024 * 1024;

async function openCache() {
  // Cache Storage exists in secure contexts only (https, or http on localhost / 127.0.0.1)
  if (typeof caches === "undefined") return null;
  try {
    return await caches.open(CACHE_NAME);
  } catch {
    return null;
  }
}

async function sha256Hex(bytes) {
  if (!globalThis.crypto?.subtle) return null;  // (insecure contexts have no SubtleCrypto: not checked there)
  const d = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(d, (b) => b.toString(16).padStart(2, "0")).join("");
}

// Fetch url's body into one Uint8Array of `expected` bytes, reporting each chunk's length to onBytes.
async function download(url, expected, onBytes) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`cannot fetch ${url}: HTTP ${r.status}`);
  const out = new Uint8Array(expected);
  let at = 0;
  const reader = r.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (at + value.length > expected) throw new Error(`${url} is larger than the manifest's ${expected} bytes`);
    out.set(value, at);
    at += value.length;
    onBytes(value.length);
  }
  if (at !== expected) throw new Error(`${url} is ${at} bytes, the manifest says ${expected}`);
  return out;
}

export class BundleFiles {
  // base: the bundle folder's URL (ending in /); manifest: its parsed manifest.json
  constructor(base, manifest, onProgress = () => {}) {
    this.base = base;
    this.manifest = manifest;
    this.onProgress = onProgress;
    this.total = Object.values(manifest.files).reduce((s, f) => s + f.bytes, 0);
    this.done = 0;  // bytes fetched or read from the cache so far
    this.fromNetwork = 0;  // of which downloaded
    this.cache = null;
  }

  // a file the page reads otherwise (a ranged token table, table.js): not part of the load's total
  leaveOut(name) {
    this.total -= this.manifest.files[name].bytes;
  }

  async get(name) {
    const entry = this.manifest.files[name];
    if (!entry) throw new Error(`the manifest does not list ${name}`);
    this.cache ??= await openCache();
    const parts = Math.max(1, Math.ceil(entry.bytes / PART_BYTES));
    const keys = Array.from({ length: parts }, (_, i) => new URL(`${name}?sha256=${entry.sha256}&part=${i + 1}of${parts}`, this.base).href);
    if (this.cache) {
      const hit = await this.cached(keys, entry.bytes);
      if (hit) {
        this.count(hit.length, false);
        return hit;
      }
    }
    const bytes = await download(new URL(name, this.base).href, entry.bytes, (n) => this.count(n, true));
    const digest = await sha256Hex(bytes);
    if (digest !== null && digest !== entry.sha256) throw new Error(`${name} does not match the manifest's sha256 (an altered or truncated bundle)`);
    if (this.cache) {
      try {
        for (let i = 0; i < parts; i++) {
          const part = bytes.subarray(i * PART_BYTES, Math.min(entry.bytes, (i + 1) * PART_BYTES));
          await this.cache.put(keys[i], new Response(part, { headers: { "Content-Type": "application/octet-stream" } }));
        }
      } catch (e) {
        console.warn(`vlmrt: ${name} not cached (${e.message}): a reload downloads it again`);
        for (const k of keys) await this.cache.delete(k);
      }
    }
    return bytes;
  }

  // the file from the cache's parts, or null (a part missing or of the wrong size: the parts are dropped)
  async cached(keys, size) {
    const out = new Uint8Array(size);
    let at = 0;
    for (const k of keys) {
      const hit = await this.cache.match(k);
      const part = hit ? new Uint8Array(await hit.arrayBuffer()) : null;
      if (!part || at + part.length > size) {
        if (at > 0 || part) for (const key of keys) await this.cache.delete(key);
        return null;
      }
      out.set(part, at);
      at += part.length;
    }
    return at === size ? out : null;
  }

  count(n, network) {
    this.done += n;
    if (network) this.fromNetwork += n;
    this.onProgress({ done: this.done, total: this.total, fromNetwork: this.fromNetwork });
  }
}

// Remove every cached bundle file (the page's "forget the cached model").
export async function clearCache() {
  if (typeof caches !== "undefined") await caches.delete(CACHE_NAME);
}
