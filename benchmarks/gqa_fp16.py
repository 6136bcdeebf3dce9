"""ORT's CPU GroupQueryAttention with a float16 cache vs float32: one decode step's attention (9 q heads, 3 kv heads,
head_dim 64, do_rotary, past/present bound to one buffer of 1024 slots) at several positions, 1 intra-op thread,
the calling thread's CPU time (median of 300 calls). Usage: python benchmarks/gqa_fp16.py (needs onnx)."""
import time, numpy as np, onnxruntime as ort
from onnx import TensorProto as T, helper as h
H, KV, D, MAX = 9, 3, 64, 1024
def model(dt):
    tt = T.FLOAT16 if dt == np.float16 else T.FLOAT
    ins = [h.make_tensor_value_info("q", tt, [1, 1, H*D]), h.make_tensor_value_info("k", tt, [1, 1, KV*D]),
           h.make_tensor_value_info("v", tt, [1, 1, KV*D]),
           h.make_tensor_value_info("pk", tt, [1, KV, MAX, D]), h.make_tensor_value_info("pv", tt, [1, KV, MAX, D]),
           h.make_tensor_value_info("sl", T.INT32, [1]), h.make_tensor_value_info("tot", T.INT32, []),
           h.make_tensor_value_info("cos", tt, [MAX, D//2]), h.make_tensor_value_info("sin", tt, [MAX, D//2])]
    outs = [h.make_tensor_value_info("o", tt, [1, 1, H*D]), h.make_tensor_value_info("ok", tt, [1, KV, MAX, D]),
            h.make_tensor_value_info("ov", tt, [1, KV, MAX, D])]
    n = h.make_node("GroupQueryAttention", ["q","k","v","pk","pv","sl","tot","cos","sin"], ["o","ok","ov"], domain="com.microsoft",
                    num_heads=H, kv_num_heads=KV, do_rotary=1)
    m = h.make_model(h.make_graph([n], "g", ins, outs), opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    return m.SerializeToString()
res = {}
for dt in (np.float32, np.float16):
    so = ort.SessionOptions(); so.intra_op_num_threads = 1
    try:
        s = ort.InferenceSession(model(dt), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        print(dt, "fails:", str(e)[:200]); continue
    rng = np.random.default_rng(0)
    pk = rng.standard_normal((1, KV, MAX, D)).astype(dt); pv = rng.standard_normal((1, KV, MAX, D)).astype(dt)
    ang = np.outer(np.arange(MAX), 1/1e5**(np.arange(0, D, 2)/D))
    feeds = dict(q=rng.standard_normal((1,1,H*D)).astype(dt), k=rng.standard_normal((1,1,KV*D)).astype(dt), v=rng.standard_normal((1,1,KV*D)).astype(dt),
                 cos=np.cos(ang).astype(dt), sin=np.sin(ang).astype(dt))
    io = s.io_binding()
    for k, v in feeds.items(): io.bind_cpu_input(k, v)
    okv = ort.OrtValue.ortvalue_from_numpy(pk); ovv = ort.OrtValue.ortvalue_from_numpy(pv)
    io.bind_ortvalue_input("pk", okv); io.bind_ortvalue_output("ok", okv); io.bind_ortvalue_input("pv", ovv); io.bind_ortvalue_output("ov", ovv)
    o = np.zeros((1,1,H*D), dt); io.bind_ortvalue_output("o", ort.OrtValue.ortvalue_from_numpy(o))
    for pos in (8, 128, 300, 600):
        sl = np.array([pos], np.int32); tot = np.array(pos+1, np.int32)
        io.bind_cpu_input("sl", sl); io.bind_cpu_input("tot", tot)
        ts = []
        for _ in range(300):
            t = time.thread_time_ns(); s.run_with_iobinding(io); ts.append(time.thread_time_ns() - t)
        res[(dt.__name__, pos)] = np.median(ts)/1000
for k, v in res.items(): print(k, f"{v:.1f} us")
