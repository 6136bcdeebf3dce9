"""Item 1 of issue 18, probed: one decode step's attention (9 q heads, 3 kv heads, head_dim 64, RoPE, 300 cached
positions), two ways:
A: the pattern of today's graph (RoPE as Split/Neg/Concat/Mul/Add, KV repeat, MatMul, mask Add, Softmax, MatMul)
B: com.microsoft GroupQueryAttention (packed QKV, do_rotary with cos/sin caches, past/present shared buffer).
Checks B's output against A's and the row B writes into its shared cache buffer, times both (min / median of 300 calls;
A through run() with feeds, B through I/O binding). Usage: python benchmarks/gqa_probe.py (needs onnx)."""
import time

import numpy as np
import vlmrt  # noqa: F401,E402  (first: it turns onnxruntime's telemetry off before onnxruntime is imported)
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

H, KV, D, CTX, MAX = 9, 3, 64, 300, 512
rng = np.random.default_rng(0)
theta = 1e5
inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
ang = np.outer(np.arange(MAX), inv)  # [MAX, D/2]
cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

def rope_np(x, pos):  # x [heads, D], HF rotate_half
    c = np.concatenate([cos[pos], cos[pos]]); s = np.concatenate([sin[pos], sin[pos]])
    x1, x2 = x[:, :D // 2], x[:, D // 2:]
    return x * c + np.concatenate([-x2, x1], -1) * s

# graph A: inputs q [1, H*D], k [1, KV*D], v, past_k [CTX, KV*D] (post-RoPE), past_v, cosr/sinr [1, D], mask [1, CTX+1]
nodes, inits = [], []
def c(name, arr): inits.append(nh.from_array(np.asarray(arr), name)); return name
def rope(x, heads, out):
    r = out + "_r"
    nodes.append(h.make_node("Reshape", [x, c(out + "_s", np.array([heads, D], np.int64))], [r]))
    nodes.append(h.make_node("Split", [r, c(out + "_sp", np.array([D // 2, D // 2], np.int64))], [out + "_1", out + "_2"], axis=-1))
    nodes.append(h.make_node("Neg", [out + "_2"], [out + "_n"]))
    nodes.append(h.make_node("Concat", [out + "_n", out + "_1"], [out + "_rot"], axis=-1))
    nodes.append(h.make_node("Mul", [r, "cosr"], [out + "_a"]))
    nodes.append(h.make_node("Mul", [out + "_rot", "sinr"], [out + "_b"]))
    nodes.append(h.make_node("Add", [out + "_a", out + "_b"], [out]))
rope("q", H, "qr"); rope("k", KV, "kr")
nodes.append(h.make_node("Reshape", ["kr", c("kflat", np.array([1, KV * D], np.int64))], ["new_k"]))
nodes.append(h.make_node("Concat", ["past_k", "new_k"], ["kall"], axis=0))
nodes.append(h.make_node("Concat", ["past_v", "v"], ["vall"], axis=0))
for n, src in (("K", "kall"), ("V", "vall")):
    nodes.append(h.make_node("Reshape", [src, c(n + "s1", np.array([-1, KV, 1, D], np.int64))], [n + "1"]))
    nodes.append(h.make_node("Expand", [n + "1", c(n + "e", np.array([1, KV, H // KV, D], np.int64))], [n + "2"]))
    nodes.append(h.make_node("Reshape", [n + "2", c(n + "s2", np.array([-1, H, D], np.int64))], [n + "3"]))
    nodes.append(h.make_node("Transpose", [n + "3"], [n + "t"], perm=[1, 2, 0] if n == "K" else [1, 0, 2]))
nodes.append(h.make_node("Reshape", ["qr", c("qs", np.array([H, 1, D], np.int64))], ["q3"]))
nodes.append(h.make_node("MatMul", ["q3", "Kt"], ["s"]))
nodes.append(h.make_node("Mul", ["s", c("scale", np.array(1 / np.sqrt(D), np.float32))], ["s2"]))
nodes.append(h.make_node("Add", ["s2", "mask"], ["s3"]))
nodes.append(h.make_node("Softmax", ["s3"], ["p"], axis=-1))
nodes.append(h.make_node("MatMul", ["p", "Vt"], ["o"]))
nodes.append(h.make_node("Reshape", ["o", c("os", np.array([1, H * D], np.int64))], ["out"]))
f = lambda n, s: h.make_tensor_value_info(n, T.FLOAT, s)
gA = h.make_graph(nodes, "A", [f("q", [1, H * D]), f("k", [1, KV * D]), f("v", [1, KV * D]), f("past_k", [CTX, KV * D]),
                              f("past_v", [CTX, KV * D]), f("cosr", [1, D]), f("sinr", [1, D]), f("mask", [1, CTX + 1])],
                  [f("out", [1, H * D]), f("new_k", [1, KV * D])], inits)
mA = h.make_model(gA, opset_imports=[h.make_opsetid("", 17)])
# graph B: GQA, packed qkv [1, 1, (H+2KV)*D], past/present [1, KV, MAX, D] shared, seqlens_k = CTX (total - 1), total MAX
gqa = h.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_len", "cos_cache", "sin_cache"],
                  ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=H, kv_num_heads=KV, do_rotary=1)
i32 = lambda n, s: h.make_tensor_value_info(n, T.INT32, s)
gB = h.make_graph([gqa], "B", [f("qkv", [1, 1, (H + 2 * KV) * D]), f("past_key", [1, KV, MAX, D]), f("past_value", [1, KV, MAX, D]),
                              i32("seqlens_k", [1]), i32("total_len", [])],
                  [f("out", [1, 1, H * D]), f("present_key", [1, KV, MAX, D]), f("present_value", [1, KV, MAX, D])],
                  [nh.from_array(cos, "cos_cache"), nh.from_array(sin, "sin_cache")])
mB = h.make_model(gB, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
sA = ort.InferenceSession(mA.SerializeToString(), so, providers=["CPUExecutionProvider"])
sB = ort.InferenceSession(mB.SerializeToString(), so, providers=["CPUExecutionProvider"])
# data: pre-RoPE k of the past positions; cache holds post-RoPE k
q, k, v = (rng.standard_normal((1, n * D)).astype(np.float32) for n in (H, KV, KV))
kp = rng.standard_normal((CTX, KV, D)).astype(np.float32)
vp = rng.standard_normal((CTX, KV * D)).astype(np.float32)
kp_rot = np.stack([rope_np(kp[p], p) for p in range(CTX)]).reshape(CTX, KV * D).astype(np.float32)
c2 = np.concatenate([cos[CTX], cos[CTX]])[None]; s2 = np.concatenate([sin[CTX], sin[CTX]])[None]
fa = {"q": q, "k": k, "v": v, "past_k": kp_rot, "past_v": vp, "cosr": c2.astype(np.float32), "sinr": s2.astype(np.float32),
      "mask": np.zeros((1, CTX + 1), np.float32)}
oa = sA.run(["out"], fa)[0]
pk = np.zeros((1, KV, MAX, D), np.float32); pv = np.zeros((1, KV, MAX, D), np.float32)
pk[0, :, :CTX] = kp_rot.reshape(CTX, KV, D).transpose(1, 0, 2); pv[0, :, :CTX] = vp.reshape(CTX, KV, D).transpose(1, 0, 2)
qkv = np.concatenate([q, k, v], -1)[None]
io = sB.io_binding()
vals = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in (("qkv", qkv), ("past_key", pk), ("past_value", pv),
        ("seqlens_k", np.array([CTX], np.int32)), ("total_len", np.array(CTX + 1, np.int32)))}
for n, val in vals.items(): io.bind_ortvalue_input(n, val)
outB = np.zeros((1, 1, H * D), np.float32)
io.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(outB))
io.bind_ortvalue_output("present_key", vals["past_key"]); io.bind_ortvalue_output("present_value", vals["past_value"])
sB.run_with_iobinding(io)
print("max |A - B| =", float(np.abs(oa - outB[0]).max()), "| new k row written in place:",
      float(np.abs(pk[0, :, CTX] - rope_np(k.reshape(KV, D), CTX)).max()))
def tm(fn, n=300):
    xs = []
    for _ in range(n):
        t = time.perf_counter(); fn(); xs.append(time.perf_counter() - t)
    xs.sort(); return xs[0] * 1e6, xs[n // 2] * 1e6
print("nodes A", len(mA.graph.node), "B", len(mB.graph.node))
print("A us min/median %.1f / %.1f" % tm(lambda: sA.run(["out"], fa)))
print("B us min/median %.1f / %.1f" % tm(lambda: sB.run_with_iobinding(io)))
