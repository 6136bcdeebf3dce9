// The bundle's files, fetched from the site itself (never a CDN, never an API): bytes counted as they arrive
// (load progress), each checked against the manifest's size and sha256, and kept in the browser's Cache Storage
// under its sha256 so that a reload reads them from disk instead of downloading them again.

const CACHE_NAME = "vlmrt-bundle-v1";

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

  async get(name) {
    const entry = this.manifest.files[name];
    if (!entry) throw new Error(`the manifest does not list ${name}`);
    this.cache ??= await openCache();
    const key = new URL(`${name}?sha256=${entry.sha256}`, this.base).href;
    if (this.cache) {
      const hit = await this.cache.match(key);
      if (hit) {
        const bytes = new Uint8Array(await hit.arrayBuffer());
        if (bytes.length === entry.bytes) {
          this.count(bytes.length, false);
          return bytes;
        }
        await this.cache.delete(key);
      }
    }
    const bytes = await download(new URL(name, this.base).href, entry.bytes, (n) => this.count(n, true));
    const digest = await sha256Hex(bytes);
    if (digest !== null && digest !== entry.sha256) throw new Error(`${name} does not match the manifest's sha256 (an altered or truncated bundle)`);
    if (this.cache) {
      try {
        await this.cache.put(key, new Response(bytes, { headers: { "Content-Type": "application/octet-stream" } }));
      } catch (e) {
        console.warn(`vlmrt: ${name} not cached (${e.message}): a reload downloads it again`);
      }
    }
    return bytes;
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
