"""export/htp/softcap_sigmoid.py: a graph output tanh(x / c)·c (Gemma's final logit soft-capping) over 16 rows, quantized
as the HTP target quantizes (16-bit QDQ) and run on the HTP simulator: as 2c·sigmoid(2x / c) − c it equals the CPU
EP's in every row; as the float graph has it, the simulator's rows past 1 are wrong (the HTP's Tanh, which the rewrite
works around: if that assertion ever fails, the HTP computes the Tanh right and the rewrite can go). About 7 s."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vlmrt.export.htp import bundle as htp_bundle
from vlmrt.export.htp.calibrate import list_reader
from vlmrt.export.htp.softcap_sigmoid import softcap_as_sigmoid

pytest.importorskip("onnxruntime_qnn")

ROWS, VOCAB, CAP = 16, 64, 30.0


def softcap_graph() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits_raw"]),
             helper.make_node("Div", ["logits_raw", "cap"], ["scaled"]),
             helper.make_node("Tanh", ["scaled"], ["t"]),
             helper.make_node("Mul", ["t", "cap"], ["logits"])]
    w = np.random.default_rng(1).normal(0, 1, (32, VOCAB)).astype(np.float32)
    g = helper.make_graph(nodes, "softcap", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [ROWS, VOCAB])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(CAP, np.float32), "cap")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def logits(model: onnx.ModelProto, folder, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(CPU EP, simulator) logits of model quantized as the HTP target does, calibrated on x."""
    import onnxruntime as ort

    from vlmrt.runtime.sessions import qnn_devices

    src, dst = folder / "float.onnx", folder / "qdq.onnx"
    onnx.save(model, str(src))
    htp_bundle.quantize_graph(src, dst, list_reader([x], lambda a: {"x": a}))
    cpu = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    devs, backend = qnn_devices()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    so.add_provider_for_devices(devs, {"backend_path": backend, "htp_arch": "79", "soc_model": "69"})
    npu = ort.InferenceSession(str(dst), sess_options=so)
    return cpu.run(None, {"x": x})[0], npu.run(None, {"x": x})[0]


def test_softcapping_over_16_rows_as_a_sigmoid_equals_the_cpu_ep(tmp_path):
    x = np.random.default_rng(0).normal(0, 3, (ROWS, 32)).astype(np.float32)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cpu, npu = logits(softcap_graph(), tmp_path / "a", x)
    wrong = np.abs(cpu - npu).max(-1)
    assert (wrong[:2] < 0.5).all() and (wrong[2:] > 5).sum() >= 4, str(wrong.round(2).tolist())  # (the HTP's fault, module doc)
    m = softcap_graph()
    assert softcap_as_sigmoid(m) == 1
    assert [n.op_type for n in m.graph.node] == ["MatMul", "Div", "Mul", "Sigmoid", "Mul", "Add"]
    cpu, npu = logits(m, tmp_path / "b", x)
    want = np.tanh(x @ numpy_helper.to_array(m.graph.initializer[0]) / CAP) * CAP
    assert cpu.shape == (ROWS, VOCAB) and np.abs(want).max() > 20 and np.abs(cpu - want).max() < 1  # (8-bit weights)
    assert np.abs(cpu - npu).max() < 0.5, np.abs(cpu - npu).max(-1).round(3).tolist()
