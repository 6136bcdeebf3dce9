"""export/cpu/file_weights.py: a plain weight-only decoder graph quantized with its MatMul weights left in the data file
(each read when its node is quantized) is the graph the in-memory passes write (gemm_to_matmul, the fused q/k/v, ORT's
MatMulNBitsQuantizer), byte for byte; no layer weight is read into the graph proto, and one weight group at a time is
in memory (on main ef8b8dc every weight was read into the proto: the loaded-names assertion fails there)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

K, LAYERS = 256, 6


def _decoder_graph(folder, gemm: bool):
    """x [1, 3, K] (or [3, K] through Gemm) -> LAYERS of two projections of the same input (fused) added, a third
    projection, a residual; a MatMul head [K, 300] with a soft-capping; external data for every weight."""
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(LAYERS):
        outs = []
        for p in ("q", "k"):
            w = rng.standard_normal((K, K)).astype(np.float32)
            name = f"layers.{i}.{p}.weight"
            if gemm:
                inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), name))
                nodes.append(helper.make_node("Gemm", [x, name], [f"{name}_out"], name=f"l{i}{p}", transB=1))
            else:
                inits.append(numpy_helper.from_array(w, name))
                nodes.append(helper.make_node("MatMul", [x, name], [f"{name}_out"], name=f"l{i}{p}"))
            outs.append(f"{name}_out")
        nodes.append(helper.make_node("Add", outs, [f"h{i}"], name=f"add{i}"))
        inits.append(numpy_helper.from_array(rng.standard_normal((K, K)).astype(np.float32), f"layers.{i}.o.weight"))
        nodes.append(helper.make_node("MatMul", [f"h{i}", f"layers.{i}.o.weight"], [f"o{i}"], name=f"l{i}o"))
        nodes.append(helper.make_node("Add", [x, f"o{i}"], [f"x{i}"], name=f"res{i}"))
        x = f"x{i}"
    inits += [numpy_helper.from_array(rng.standard_normal((K, 300)).astype(np.float32), "head.weight"),
              numpy_helper.from_array(np.array(30.0, np.float32), "cap")]
    nodes += [helper.make_node("MatMul", [x, "head.weight"], ["h"], name="head"),
              helper.make_node("Div", ["h", "cap"], ["d"]), helper.make_node("Tanh", ["d"], ["t"]),
              helper.make_node("Mul", ["t", "cap"], ["logits"])]
    shape = [3, K] if gemm else [1, 3, K]
    g = helper.make_graph(nodes, "dec", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*shape[:-1], 300])], inits)
    path = folder / "decoder.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="decoder.onnx.data", size_threshold=1024)
    return path


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("gemm", [False, True])
@pytest.mark.parametrize("precision", ["w4a8", "w8a16"])
def test_weights_read_from_the_file_give_the_in_memory_graph(tmp_path, monkeypatch, gemm, precision):
    from onnx import external_data_helper

    from vlmrt.export.cpu import quantize

    path = _decoder_graph(tmp_path, gemm)
    want = quantize.quantize_decoder(onnx.load(str(path)), precision, precision, "logits")  # every weight in the proto
    loaded = []
    load = external_data_helper.load_external_data_for_tensor
    monkeypatch.setattr(external_data_helper, "load_external_data_for_tensor",
                        lambda t, base: loaded.append(t.name) or load(t, base))
    got, peak = _peak(lambda: quantize.quantize_decoder(onnx.load(str(path), load_external_data=False), precision,
                                                        precision, "logits", folder=tmp_path))
    assert sum(n.op_type == "MatMulNBits" for n in got.graph.node) == 2 * LAYERS + 1  # (fused q/k, o, the head)
    assert got.SerializeToString() == want.SerializeToString()
    assert not [n for n in loaded if n.startswith(("layers.", "head."))]  # (into the proto: none)
    # the float weights are LAYERS · 3 · K² · 4 bytes (4.7 MB); read one group at a time, the fused q/k pair (its two
    # reads and their concatenation: 6 K² · 4) is the largest thing held
    float_bytes = LAYERS * 3 * K * K * 4
    assert peak < 0.4 * float_bytes, (peak, float_bytes)
