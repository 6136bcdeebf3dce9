// The token table (the manifest's decoder.embedding_file, [vocab, row width] .npy) in its stored form
// (runtime/table_rows.py): float32 / float16 rows, int8 rows with a float32 scale per row (embedding_scale_file
// [vocab]), or int8 / 4-bit codes with a float16 scale per group of decoder.embedding_group values
// (embedding_scale_file [vocab, ⌈width / G⌉]; 4-bit codes two per byte, code + 8, a row's even column in the low
// nibble), or a split table of parts (decoder.embedding_dtype "parts", decoder.embedding_parts: each row one run of
// bytes, [vocab, row bytes] uint8, its parts side by side, each part's codes then its float16 scales, little-endian:
// Gemma 4's float16 embedding beside 4-bit per-layer columns, one request a row); rows by token id as
// runtime/decode/embedding.py reads them, float32 bit for bit (q · s in float32: Math.fround of the exact product).
// Two ways to the page:
//   whole   fetched once like every bundle file (sha256-checked, kept in Cache Storage), then indexed in memory: the
//           default up to WHOLE_TABLE_BYTES
//   ranged  only the rows the conversation uses, each one HTTP Range request (bytes of its row; a grouped table's
//           scales a second request of its scale row) as a prompt or a decode step first needs it, kept in memory
//           (at most RANGED_ROWS_KEPT rows); the file is never whole in the page. Gemma 4 E2B's table (262,144 ×
//           (1536 + 35 × 256) float16: 5.5 GB) can only come this way: a page cannot hold it (WASM memory is
//           4 GiB; a tab's ArrayBuffers are capped below that). Its cost: a 21 KB request per new token id (a
//           300-token prompt ≈ 300 requests, 6 MB; int4g32: 5.2 KB + 0.7 KB of scales), no sha256 check of the
//           file (its size and .npy header are checked) and no Cache Storage (the browser's HTTP cache may keep rows).

import { readNpy } from "./npy.js";

export const WHOLE_TABLE_BYTES = 512 * 1024 * 1024;
export const RANGED_ROWS_KEPT = 8192;

export class TableError extends Error {}

const NPY_TYPES = { "<f4": ["float32", Float32Array], "<f2": ["float16", Uint16Array], "|i1": ["int8", Int8Array],
  "|u1": ["uint8", Uint8Array] };

// IEEE half -> float32 (exact: every half is a float32)
const F16 = new Float32Array(65536);
{
  for (let h = 0; h < 65536; h++) {
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, f = h & 0x3ff;
    F16[h] = e === 0 ? s * f * 2 ** -24 : e === 31 ? (f ? NaN : s * Infinity) : s * (1 + f / 1024) * 2 ** (e - 15);
  }
}

// The stored form's row decoder: (codes: the stored row, scale: null, the row's scale, or its float16 scales'
// bits, out: Float32Array, at) -> the row's `width` values at out[at..]
function rowDecoder(dtype, group, width) {
  if (dtype === "float16") return (row, scale, out, at) => { for (let j = 0; j < width; j++) out[at + j] = F16[row[j]]; };
  if (dtype === "float32") return (row, scale, out, at) => out.set(row, at);
  if (!group) return (row, scale, out, at) => { for (let j = 0; j < width; j++) out[at + j] = Math.fround(row[j] * scale); };
  if (dtype === "int8") {
    return (row, scales, out, at) => {
      for (let j = 0; j < width; j++) out[at + j] = Math.fround(row[j] * F16[scales[Math.floor(j / group)]]);
    };
  }
  return (row, scales, out, at) => {  // int4: two codes a byte
    for (let j = 0; j < width; j++) {
      const q = ((j & 1 ? row[j >> 1] >> 4 : row[j >> 1]) & 15) - 8;
      out[at + j] = Math.fround(q * F16[scales[Math.floor(j / group)]]);
    }
  };
}

// A split table's row decoder (runtime/table_rows.py unpack): (bytes: the stored row, _, out, at) -> its parts'
// values side by side at out[at..]; each part's codes, then its float16 scales (read bytewise: a part may end on an
// odd byte). parts: the manifest's [{columns, dtype, group}]; rowBytes: the stored row's length, checked.
const PART_BYTES = { float32: (n) => 4 * n, float16: (n) => 2 * n, int8: (n) => n, int4: (n) => Math.ceil(n / 2) };
function partsDecoder(parts, width, rowBytes) {
  let at = 0, columns = 0;
  const steps = parts.map(({ columns: n, dtype, group }) => {
    const codes = PART_BYTES[dtype]?.(n), scales = group ? 2 * Math.ceil(n / group) : 0;
    const ok = codes !== undefined && ((dtype === "int8" && group === 64) || (dtype === "int4" && [32, 64].includes(group)) || (dtype.startsWith("float") && !group));
    if (!ok) throw new TableError(`a token table part of ${n} ${dtype} columns in groups of ${group} is not a form this page reads`);
    const step = { n, dtype, group, at, col: columns, scaleAt: at + codes };
    at += codes + scales;
    columns += n;
    return step;
  });
  if (columns !== width || at !== rowBytes) throw new TableError(`the token table's parts (${columns} values, ${at} bytes a row) are not its ${width} values of ${rowBytes} bytes`);
  const f16 = (row, k) => F16[row[k] | (row[k + 1] << 8)];
  return (row, _, out, o) => {
    const view = new DataView(row.buffer, row.byteOffset, row.byteLength);
    for (const { n, dtype, group, at, col, scaleAt } of steps) {
      const base = o + col;
      if (dtype === "float16") for (let j = 0; j < n; j++) out[base + j] = f16(row, at + 2 * j);
      else if (dtype === "float32") for (let j = 0; j < n; j++) out[base + j] = view.getFloat32(at + 4 * j, true);
      else if (dtype === "int8") for (let j = 0; j < n; j++) out[base + j] = Math.fround(view.getInt8(at + j) * f16(row, scaleAt + 2 * Math.floor(j / group)));
      else {
        for (let j = 0; j < n; j++) {
          const q = ((j & 1 ? row[at + (j >> 1)] >> 4 : row[at + (j >> 1)]) & 15) - 8;
          out[base + j] = Math.fround(q * f16(row, scaleAt + 2 * Math.floor(j / group)));
        }
      }
    }
  };
}

// the manifest's form, checked against the table file's dtype and row length
function formOf(m, dtype, codeWidth) {
  const d = m.decoder, group = d.embedding_group ?? null, width = d.hidden_size;
  if (d.embedding_dtype === "parts") {
    if (dtype !== "uint8") throw new TableError(`the token table (${dtype}) is not the manifest's rows of parts (uint8 bytes)`);
    return { width, group: null, decode: partsDecoder(d.embedding_parts ?? [], width, codeWidth) };
  }
  const stored = { float32: "float32", float16: "float16", int8: "int8", int4: "uint8" }[d.embedding_dtype];
  const want = d.embedding_dtype === "int4" ? Math.ceil(width / 2) : width;
  if (!stored || stored !== dtype || want !== codeWidth || (d.embedding_dtype === "int4" && !group)) {
    throw new TableError(`the token table (${dtype}, ${codeWidth} a row) is not the manifest's ${d.embedding_dtype}${group ? ` in groups of ${group}` : ""} of ${width} values`);
  }
  return { width, group, decode: rowDecoder(d.embedding_dtype, group, width) };
}

class WholeTable {
  constructor(npy, scales, form) {
    this.npy = npy;
    this.scales = scales;  // the scale file's array: [vocab] float32, or [vocab, groups] float16 bits
    this.form = form;
    [this.vocab, this.codeWidth] = npy.shape;
    this.width = form.width;
    this.mode = "whole";
  }

  scaleOf(id) {
    if (!this.scales) return null;
    if (!this.form.group) return this.scales.data[id];
    const g = this.scales.shape[1];
    return this.scales.data.subarray(id * g, (id + 1) * g);
  }

  async rows(ids) {
    const w = this.width, c = this.codeWidth, out = new Float32Array(ids.length * w);
    ids.forEach((id, i) => {
      checkId(id, this.vocab);
      this.form.decode(this.npy.data.subarray(id * c, (id + 1) * c), this.scaleOf(id), out, i * w);
    });
    return out;
  }
}

// a .npy [vocab, n] file read by rows with HTTP Range requests, the rows kept (at most RANGED_ROWS_KEPT)
class RangedRows {
  constructor(url, header) {
    Object.assign(this, header);  // vocab, width (stored values a row), dtype, Ctor, dataOffset
    this.url = url;
    this.kept = new Map();  // id -> stored row (oldest first: evicted past RANGED_ROWS_KEPT)
    this.requests = 0;
    this.bytesRead = 0;
  }

  static async open(url, size) {
    const head = await rangeGet(url, 0, Math.min(size, 4096) - 1, size);
    const text = String.fromCharCode(...head);  // (bytes as code points: the header is ASCII)
    const major = head[6], hlen = major === 1 ? head[8] | (head[9] << 8) : new DataView(head.buffer).getUint32(8, true);
    const start = major === 1 ? 10 : 12;
    const header = text.slice(start, start + hlen);
    const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
    const shape = (/'shape':\s*\(([^)]*)\)/.exec(header)?.[1] || "").split(",").map((s) => s.trim()).filter(Boolean).map(Number);
    if (!text.startsWith("\x93NUMPY") || !NPY_TYPES[descr] || /'fortran_order':\s*True/.test(header) || shape.length !== 2) {
      throw new TableError(`${url} is not a C-order [vocab, width] .npy table of float32, float16, int8 or uint8`);
    }
    const [dtype, Ctor] = NPY_TYPES[descr];
    const dataOffset = start + hlen;
    if (dataOffset + shape[0] * shape[1] * Ctor.BYTES_PER_ELEMENT !== size) throw new TableError(`${url}: its header's shape does not match the manifest's ${size} bytes`);
    return new RangedRows(url, { vocab: shape[0], width: shape[1], dtype, Ctor, dataOffset });
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
}

class RangedTable {
  // codes: the table's RangedRows; scales: null, the [vocab] float32 row scales (fetched whole), or the grouped
  // scales' RangedRows (a row each)
  constructor(codes, scales, form) {
    Object.assign(this, { codes, scales, form, vocab: codes.vocab, width: form.width, mode: "ranged" });
  }

  get requests() { return this.codes.requests + (this.scales?.requests ?? 0); }

  get bytesRead() { return this.codes.bytesRead + (this.scales?.bytesRead ?? 0); }

  async scaleOf(id) {
    if (!this.scales) return null;
    return this.form.group ? this.scales.row(id) : this.scales[id];
  }

  async rows(ids) {
    ids.forEach((id) => checkId(id, this.vocab));
    const w = this.width, out = new Float32Array(ids.length * w);
    const rows = await Promise.all([...new Set(ids)].map(async (id) => [id, [await this.codes.row(id), await this.scaleOf(id)]]));
    const byId = new Map(rows);
    ids.forEach((id, i) => this.form.decode(...byId.get(id), out, i * w));
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
  const name = m.decoder.embedding_file, entry = m.files[name], scaleName = m.decoder.embedding_scale_file;
  if (!entry) throw new TableError(`the manifest does not list ${name}`);
  if (how !== null && !["whole", "ranged"].includes(how)) throw new TableError(`table: '${how}' is not whole or ranged`);
  const grouped = Boolean(m.decoder.embedding_group);
  const graphData = Object.values(m.graphs ?? {}).some((g) => (g.data_files ?? []).includes(name));
  const bytes = entry.bytes + (grouped ? m.files[scaleName]?.bytes ?? 0 : 0);
  if ((how ?? (bytes > WHOLE_TABLE_BYTES && !graphData ? "ranged" : "whole")) === "whole") {
    const npy = readNpy(await files.get(name)), scales = scaleName ? readNpy(await files.get(scaleName)) : null;
    return new WholeTable(npy, scales, formOf(m, npy.dtype, npy.shape[1]));
  }
  files.leaveOut(name);
  const codes = await RangedRows.open(new URL(name, files.base).href, entry.bytes);
  let scales = null;
  if (grouped) {
    files.leaveOut(scaleName);
    scales = await RangedRows.open(new URL(scaleName, files.base).href, m.files[scaleName].bytes);
  } else if (scaleName) {
    scales = readNpy(await files.get(scaleName)).data;
  }
  return new RangedTable(codes, scales, formOf(m, codes.dtype, codes.width));
}
