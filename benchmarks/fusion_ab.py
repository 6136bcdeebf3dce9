"""A/B of quantize.fuse_shared_input_matmuls on one decode step: the same float decode graph quantized with and
without the fusion, outputs compared, then interleaved timings (ms per call over 40 calls, 6 rounds).

It takes the portable (rows-contract) decoder: a bundle exported with `--attention portable`.

    python benchmarks/fusion_ab.py BUNDLE_FP32/decoder.onnx [--quant w4a8] [--threads 2] [--pos 300]
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import vlmrt  # noqa: F401,E402  (first: it turns onnxruntime's telemetry off before onnxruntime is imported)
import onnxruntime as ort  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vlmrt.export.cpu import quantize  # noqa: E402
from vlmrt.runtime.kv_cache import context_slots  # noqa: E402


def build(src: str, prec: str, fuse: bool, out: Path) -> str:
    real = quantize.fuse_shared_input_matmuls
    if not fuse:
        quantize.fuse_shared_input_matmuls = lambda model, keep_apart: 0
    try:
        q = quantize.quantize_decoder(onnx.load(src), prec, prec, "logits")
    finally:
        quantize.fuse_shared_input_matmuls = real
    path = out / f"decode_{'fused' if fuse else 'plain'}.onnx"
    onnx.save(q, str(path), save_as_external_data=True, location=path.name + ".data")
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("graph", help="a float (fp32) decoder graph with a symbolic cache length (decoder.onnx, or decode.onnx)")
    ap.add_argument("--quant", default="w4a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pos", type=int, default=300)
    a = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="fusion-ab-"))
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.log_severity_level = a.threads, 3
    paths = {f: build(a.graph, a.quant, f, out) for f in (False, True)}
    sess = {f: ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]) for f, p in paths.items()}
    ctx = context_slots(a.pos, 64, 1 << 30)  # the default --context-step
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess[True].get_inputs():
        # one decode step: "ctx" slots of cache, "ar" = 1 token, the mask's "ctx + ar" / "ctx + 1"
        shape = [d if isinstance(d, int) else ctx if d == "ctx" else 1 if d == "ar" else ctx + 1 for d in i.shape]
        if i.name == "position_ids":
            feeds[i.name] = np.array([a.pos])
        elif i.name == "logit_rows":
            feeds[i.name] = np.array([0])
        elif i.name == "attention_mask":
            feeds[i.name] = np.zeros(shape, np.float32)
            feeds[i.name][0, a.pos:ctx] = np.finfo(np.float32).min
        else:
            feeds[i.name] = (rng.standard_normal(shape) * 0.5).astype(np.float32)
    outs = {f: s.run(None, feeds) for f, s in sess.items()}
    diff = max(float(np.abs(x - y).max()) for x, y in zip(outs[False], outs[True]))
    nodes = {f: sum(n.op_type == "MatMulNBits" for n in onnx.load(p, load_external_data=False).graph.node)
             for f, p in paths.items()}
    times = {f: [] for f in sess}
    for _ in range(6):
        for f, s in sess.items():
            t = time.perf_counter()
            for _ in range(40):
                s.run(None, feeds)
            times[f].append((time.perf_counter() - t) / 40 * 1000)
    print(f"{a.quant}, ctx {ctx}, {a.threads} threads; outputs max abs diff {diff}")
    for f in (False, True):
        print(f"{'fused' if f else 'plain'}: {nodes[f]} MatMulNBits, ms/step " + " ".join(f"{t:.2f}" for t in sorted(times[f]))
              + f"  (median {np.median(times[f]):.2f})")


if __name__ == "__main__":
    main()
