"""One MatMulNBits call (M = 1, a decode step's shape) per accuracy_level and block size on this CPU: which kernels
ORT's CPU EP has. 10 random 4-bit weights of each decoder shape in one graph (the lm head alone), min and median
per call over 40 runs. Usage: python -m benchmarks.mnb_levels [threads] [levels, e.g. 4,0,1,2,3] [blocks, e.g. 32,64]"""
import sys
import time

import numpy as np
import vlmrt  # noqa: F401,E402  (first: it turns onnxruntime's telemetry off before onnxruntime is imported)
import onnxruntime as ort
from onnx import TensorProto, helper


def graph(k: int, n: int, block: int, level: int, reps: int) -> bytes:
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for r in range(reps):
        w = rng.integers(0, 255, (n, k // block, block // 2), dtype=np.uint8)
        s = rng.random(n * (k // block), dtype=np.float32) * 0.01
        inits += [helper.make_tensor(f"w{r}", TensorProto.UINT8, w.shape, w.tobytes(), raw=True),
                  helper.make_tensor(f"s{r}", TensorProto.FLOAT, s.shape, s.tobytes(), raw=True)]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"w{r}", f"s{r}"], [f"y{r}"], domain="com.microsoft", K=k, N=n,
                                      bits=4, block_size=block, accuracy_level=level))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info(f"y{r}", TensorProto.FLOAT, [1, n]) for r in range(reps)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    levels = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4,0,1,2,3").split(",")]
    blocks = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "32").split(",")]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    # SmolLM2-135M's decode shapes: gate/up packed [576 -> 3072], down [1536 -> 576], the lm head [576 -> 49152]
    for k, n, reps in ((576, 3072, 10), (1536, 576, 10), (576, 49152, 1)):
        x = np.random.default_rng(1).standard_normal((1, k), dtype=np.float32)
        for level in levels:
            for block in blocks:
                s = ort.InferenceSession(graph(k, n, block, level, reps), so, providers=["CPUExecutionProvider"])
                for _ in range(5):
                    s.run(None, {"x": x})
                ts = []
                for _ in range(40):
                    t = time.perf_counter()
                    s.run(None, {"x": x})
                    ts.append(time.perf_counter() - t)
                print(f"K={k:5d} N={n:5d} accuracy_level={level} block={block}: min {1e6 * min(ts) / reps:7.1f} µs, "
                      f"median {1e6 * float(np.median(ts)) / reps:7.1f} µs per call", flush=True)


if __name__ == "__main__":
    main()
