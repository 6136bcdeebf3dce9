"""One GroupQueryAttention node (SmolLM2-135M's layer: 9 heads, 3 KV heads, 64 dims) prefilling N rows in blocks of B
into an in-place cache of 4352 slots, float32 vs int8 (ORT 1.32's quantized cache, K and V per channel): the wall
seconds of the whole prefill, × 30 layers (the decoder's attention share of a prompt's TTFT).

    python -m benchmarks.gqa_prefill [--tokens 4000] [--blocks 32,128,256,512] [--threads 2]

ORT 1.32's CPU kernel refuses different K and V quantization types ("requires k_quant_type == v_quant_type"), so V
per tensor beside K per channel is not a choice."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper

H, KV, D, MAX, LAYERS = 9, 3, 64, 4352, 30


def session(bits: int, threads: int) -> ort.InferenceSession:
    ct = T.FLOAT if bits == 0 else T.INT8
    ins = [helper.make_tensor_value_info("q", T.FLOAT, [1, "s", H * D]),
           helper.make_tensor_value_info("k", T.FLOAT, [1, "s", KV * D]),
           helper.make_tensor_value_info("v", T.FLOAT, [1, "s", KV * D]),
           helper.make_tensor_value_info("pk", ct, [1, KV, MAX, D]), helper.make_tensor_value_info("pv", ct, [1, KV, MAX, D]),
           helper.make_tensor_value_info("sl", T.INT32, [1]), helper.make_tensor_value_info("tot", T.INT32, [])]
    extra, attrs = [], {}
    if bits:
        ins += [helper.make_tensor_value_info("ks", T.FLOAT, [KV, 1, D]), helper.make_tensor_value_info("vs", T.FLOAT, [KV, 1, D])]
        extra = ["", "", "", "", "", "ks", "vs"]
        attrs = dict(kv_cache_bit_width=bits, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
    outs = [helper.make_tensor_value_info("o", T.FLOAT, [1, "s", H * D]),
            helper.make_tensor_value_info("prk", ct, [1, KV, MAX, D]), helper.make_tensor_value_info("prv", ct, [1, KV, MAX, D])]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tot", *extra], ["o", "prk", "prv"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=KV, **attrs)
    m = helper.make_model(helper.make_graph([node], "g", ins, outs),
                          opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    return ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])


def prefill(bits: int, n: int, block: int, threads: int) -> float:
    s, rng = session(bits, threads), np.random.default_rng(0)
    dt = np.float32 if bits == 0 else np.int8
    pk, pv = (ort.OrtValue.ortvalue_from_numpy(np.zeros((1, KV, MAX, D), dt)) for _ in range(2))
    q, k, v = (rng.standard_normal((1, block, h * D), np.float32) for h in (H, KV, KV))
    scale = np.full((KV, 1, D), 0.03, np.float32)
    t = time.perf_counter()
    for lo in range(0, n, block):
        ar, b = min(block, n - lo), s.io_binding()
        feed = dict(q=q[:, :ar], k=k[:, :ar], v=v[:, :ar], sl=np.array([lo + ar - 1], np.int32), tot=np.array(lo + ar, np.int32))
        if bits:
            feed.update(ks=scale, vs=scale)
        for name, x in feed.items():
            b.bind_cpu_input(name, np.ascontiguousarray(x))
        b.bind_ortvalue_input("pk", pk), b.bind_ortvalue_input("pv", pv)
        b.bind_ortvalue_output("prk", pk), b.bind_ortvalue_output("prv", pv), b.bind_output("o")
        s.run_with_iobinding(b)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--blocks", default="32,128,256,512")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for block in (int(x) for x in a.blocks.split(",")):
        f, q = (prefill(bits, a.tokens, block, a.threads) * LAYERS for bits in (0, 8))
        print(json.dumps({"tokens": a.tokens, "block": block, "fp32_s": round(f, 2), "int8_s": round(q, 2),
                          "int8_over_fp32": round(q / f, 2)}), flush=True)


if __name__ == "__main__":
    main()
