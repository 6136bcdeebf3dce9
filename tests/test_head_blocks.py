"""export/cpu/head_blocks.py: the lm head quantized from the graph's data file a block of vocabulary rows at a time
gives the node and tensors that gemm_to_matmul + ORT's MatMulNBitsQuantizer give from the whole head (on main
f2d6421 there was no such path: the head was read into the proto whole and copied on its way to MatMulNBits)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def _head_graph(folder, gemm: bool, n: int = 1000, k: int = 64):
    """x [1, K] -> logits [1, N] through a Gemm(transB) or MatMul head and a soft-capping, saved with external data."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32)
    cap = numpy_helper.from_array(np.array(30.0, np.float32), "cap")
    if gemm:
        head = helper.make_node("Gemm", ["x", "W"], ["h"], name="head", transB=1, alpha=1.0, beta=1.0, transA=0)
        init = numpy_helper.from_array(w, "W")
    else:
        head = helper.make_node("MatMul", ["x", "W"], ["h"], name="head")
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "W")
    nodes = [head, helper.make_node("Div", ["h", "cap"], ["d"]), helper.make_node("Tanh", ["d"], ["t"]),
             helper.make_node("Mul", ["t", "cap"], ["logits"])]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, n])], [init, cap])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "head.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="head.onnx.data", size_threshold=1024)
    return path


@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize("head", ["w4a8", "w8a16"])
def test_head_in_row_blocks_equals_the_quantizer_on_the_whole_head(tmp_path, monkeypatch, gemm, head):
    from vlmrt.export.cpu import head_blocks, quantize

    path = _head_graph(tmp_path, gemm)
    want = quantize.quantize_decoder(onnx.load(str(path)), "fp32", head, "logits")  # the whole head, in the proto
    monkeypatch.setattr(head_blocks, "BLOCK_BYTES", 4 * 64 * 96)  # blocks of 96 of the 1000 rows
    calls = []
    kernel = head_blocks.quantize_head
    monkeypatch.setattr(head_blocks, "quantize_head", lambda *a: calls.append(a[3]) or kernel(*a))
    got = quantize.quantize_decoder(onnx.load(str(path), load_external_data=False), "fp32", head, "logits",
                                    folder=tmp_path)
    assert calls == [quantize.WEIGHT_ONLY_BITS[head]]  # (the block path ran)
    assert [(n.op_type, n.name, list(n.input), n.attribute) for n in got.graph.node] == \
        [(n.op_type, n.name, list(n.input), n.attribute) for n in want.graph.node]
    assert [i.name for i in got.graph.initializer] == [i.name for i in want.graph.initializer]
    for a, b in zip(got.graph.initializer, want.graph.initializer):
        assert a.data_type == b.data_type and list(a.dims) == list(b.dims)
        assert numpy_helper.to_array(a).tobytes() == numpy_helper.to_array(b).tobytes(), a.name
    assert {(o.domain, o.version) for o in got.opset_import} == {(o.domain, o.version) for o in want.opset_import}
