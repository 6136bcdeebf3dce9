// The token table (the manifest's decoder.embedding_file, [vocab, row width] .npy, float32 / float16, or int8 rows
// with a scale file), rows by token id as runtime/decode/embedding.py reads them. Two ways to the page:
//   whole   fetched once like every bundle file (sha256-checked, kept in Cache Storage), then indexed in memory: the
//           default up to WHOLE_TABLE_BYTES
//   ranged  only the rows the conversation uses, each one HTTP Range request (bytes of its row) as a prompt or a
//           decode step first needs it, kept in memory (at most RANGED_ROWS_KEPT rows); the file is never whole in
//           the page. Gemma 4 E2B's table (262,144 × (1536 + 35 × 256) float16: 5.5 GB) can only come this way: a
//           page cannot hold it (WASM memory is 4 GiB; a tab's ArrayBuffers are capped below that). Its cost: a
//           21 KB request per new token id (a 300-token prompt ≈ 300 requests, 6 MB), no sha256 check of the
//           file (its size and .npy header are checked) and no Cache Storage (the browser's HTTP cache may keep rows).

import { readNpy } from "./npy.js";

export const WHOLE_TABLE_BYTES = 512 * 1024 * 1024;
export const RANGED_ROWS_KEPT = 8192;

export class TableError extends Error {}

const NPY_TYPES = { "<f4": ["float32", Float32Array], "<f2": ["float16", Uint16Array], "|i1": ["int8", Int8Array] };

// IEEE half -> float32 (exact: every half is a float32)
const F16 = new Float32Array(65536);
{
  for (let h = 0; h < 65536; h++) {
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    F16[h] = e === 0 ? s * f * 2 ** -24 : e === 31 ? (f ? NaN : s * Infinity) : s * (1 + f / 1024) * 2 ** (e - 15);
  }
}

// one stored row (typed array of the file's dtype) times its scale (int8 rows) into out (Float32Array) at `at`
function widen(row, dtype, scale, out, at) {
  if (dtype === "float16") for (let j = 0; j < row.length; j++) out[at + j] = F16[row[j]];
  else if (scale !== null) for (let j = 0; j < row.length; j++) out[at + j] = Math.fround(row[j] * scale);
  else out.set(row, at);
}

class WholeTable {
  constructor(npy, scales) {
    this.npy = npy;
    this.scales = scales;
    [this.vocab, this.width] = npy.shape;
    this.mode = "whole";
  }

  async rows(ids) {
    const w = this.width, out = new Float32Array(ids.length * w);
    ids.forEach((id, i) => {
      checkId(id, this.vocab);
      widen(this.npy.data.subarray(id * w, (id + 1) * w), this.npy.dtype, this.scales ? this.scales[id] : null, out, i * w);
    });
    return out;
  }
}

class RangedTable {
  constructor(url, header, scales) {
    Object.assign(this, header);  // vocab, width, dtype, Ctor, dataOffset
    this.url = url;
    this.scales = scales;
    this.kept = new Map();  // id -> stored row (oldest first: evicted past RANGED_ROWS_KEPT)
    this.requests = 0;
    this.bytesRead = 0;
    this.mode = "ranged";
  }

  static async open(url, size, scales) {
    const head = await rangeGet(url, 0, Math.min(size, 4096) - 1, size);
    const text = String.fromCharCode(...head);  // (bytes as code points: the header is ASCII)
    const major = head[6], hlen = major === 1 ? head[8] | (head[9] << 8) : new DataView(head.buffer).getUint32(8, true);
    const start = major === 1 ? 10 : 12;
    const header = text.slice(start, start + hlen);
    const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
    const shape = (/'shape':\s*\(([^)]*)\)/.exec(header)?.[1] || "").split(",").map((s) => s.trim()).filter(Boolean).map(Number);
    if (!text.startsWith("\x93NUMPY") || !NPY_TYPES[descr] || /'fortran_order':\s*True/.test(header) || shape.length !== 2) {
      throw new TableError(`${url} is not a C-order [vocab, width] .npy table of float32, float16 or int8`);
    }
    const [dtype, Ctor] = NPY_TYPES[descr];
    const dataOffset = start + hlen;
    if (dataOffset + shape[0] * shape[1] * Ctor.BYTES_PER_ELEMENT !== size) throw new TableError(`${url}: its header's shape does not match the manifest's ${size} bytes`);
    return new RangedTable(url, { vocab: shape[0], width: shape[1], dtype, Ctor, dataOffset }, scales);
  }

  async row(id) {
    let r = this.kept.get(id);
    if (r) return r;
    const bytes = this.width * this.Ctor.BYTES_PER_ELEMENT, at = this.dataOffset + id * bytes;
    const got = await rangeGet(this.url, at, at + bytes - 1, null);
    this.requests++;
    this.bytesRead += bytes;
    r = new this.Ctor(got.buffer, got.byteOffset, this.width);
    if (this.kept.size >= RANGED_ROWS_KEPT) this.kept.delete(this.kept.keys().next().value);
    this.kept.set(id, r);
    return r;
  }

  async rows(ids) {
    ids.forEach((id) => checkId(id, this.vocab));
    const w = this.width, out = new Float32Array(ids.length * w);
    const rows = await Promise.all([...new Set(ids)].map(async (id) => [id, await this.row(id)]));
    const byId = new Map(rows);
    ids.forEach((id, i) => widen(byId.get(id), this.dtype, this.scales ? this.scales[id] : null, out, i * w));
    return out;
  }
}

function checkId(id, vocab) {
  if (!(Number.isInteger(id) && id >= 0 && id < vocab)) throw new RangeError(`token id ${id} out of range 0..${vocab - 1}`);
}

// bytes first..last of url (a 206 answer of exactly that many bytes; size: the file's, checked when given)
async function rangeGet(url, first, last, size) {
  const r = await fetch(url, { headers: { Range: `bytes=${first}-${last}` } });
  if (r.status !== 206) {
    throw new TableError(`the site's server answered a Range request for ${url} with HTTP ${r.status}, not 206: this bundle's token table is read by rows (HTTP Range) and needs a server that takes Range requests (vlmrt web --serve, nginx, most static hosts)`);
  }
  const total = Number(/\/(\d+)$/.exec(r.headers.get("Content-Range") || "")?.[1]);
  if (size !== null && total !== size) throw new TableError(`${url} is ${total} bytes, the manifest says ${size}`);
  const bytes = new Uint8Array(await r.arrayBuffer());
  if (bytes.length !== last - first + 1) throw new TableError(`${url}: a Range request for ${last - first + 1} bytes gave ${bytes.length}`);
  return bytes;
}

// The bundle's token table: ranged when asked ("ranged") or when the file is over WHOLE_TABLE_BYTES (auto: null),
// unless a graph reads it as external data (a tied w4a16o head's rows: fetched whole for the session anyway), else
// whole. files: the bundle's BundleFiles (a ranged table's bytes leave its load total).
export async function openTable(files, m, how = null) {
  const name = m.decoder.embedding_file, entry = m.files[name];
  if (!entry) throw new TableError(`the manifest does not list ${name}`);
  if (how !== null && !["whole", "ranged"].includes(how)) throw new TableError(`table: '${how}' is not whole or ranged`);
  const scales = m.decoder.embedding_scale_file ? readNpy(await files.get(m.decoder.embedding_scale_file)).data : null;
  const graphData = Object.values(m.graphs ?? {}).some((g) => (g.data_files ?? []).includes(name));
  if ((how ?? (entry.bytes > WHOLE_TABLE_BYTES && !graphData ? "ranged" : "whole")) === "whole") {
    return new WholeTable(readNpy(await files.get(name)), scales);
  }
  files.leaveOut(name);
  return RangedTable.open(new URL(name, files.base).href, entry.bytes, scales);
}
