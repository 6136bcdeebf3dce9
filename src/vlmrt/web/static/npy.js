// A .npy file (NumPy's format, version 1-3, C order) -> {dtype, shape, data: a typed array over the bytes}.
const TYPES = { "<f4": ["float32", Float32Array], "<f2": ["float16", Uint16Array], "|i1": ["int8", Int8Array], "|u1": ["uint8", Uint8Array], "<i8": ["int64", BigInt64Array] };

export function readNpy(bytes) {
  const magic = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59];
  if (!magic.every((b, i) => bytes[i] === b)) throw new Error("not a .npy file");
  const major = bytes[6];
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const hlen = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const start = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(bytes.subarray(start, start + hlen));
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  const fortran = /'fortran_order':\s*True/.test(header);
  const shape = (/'shape':\s*\(([^)]*)\)/.exec(header)?.[1] || "").split(",").map((s) => s.trim()).filter(Boolean).map(Number);
  if (!TYPES[descr] || fortran) throw new Error(`unsupported .npy array (${descr}${fortran ? ", Fortran order" : ""})`);
  const [dtype, Ctor] = TYPES[descr];
  const offset = bytes.byteOffset + start + hlen;
  const count = shape.reduce((a, b) => a * b, 1);
  // typed arrays need an aligned offset: copy when the header leaves the data unaligned
  const data = offset % Ctor.BYTES_PER_ELEMENT === 0 ? new Ctor(bytes.buffer, offset, count)
    : new Ctor(bytes.slice(start + hlen, start + hlen + count * Ctor.BYTES_PER_ELEMENT).buffer);
  return { dtype, shape, data };
}
