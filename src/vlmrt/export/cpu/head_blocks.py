"""The lm head's weight-only quantization (MatMulNBits, symmetric blocks along K), read from the graph's data file a
block of vocabulary rows at a time: the head is the largest matrix of a decoder (262,144 × 1536 at Gemma 4's
vocabulary: 1.6 GB as float32), and read into the graph proto whole it was copied four times over on the way to
MatMulNBits (to numpy, transposed, back into the proto; ORT's quantizer's own copy).

MatMulNBits quantizes each output column n (a vocabulary row) on its own: packed [N, K / block, block · bits / 8],
scales [N, K / block]. So rows n0..n1 of the head, quantized with ORT's own kernel (quantize_matmul_4bits / 8bits,
what MatMulNBitsQuantizer calls), are rows n0..n1 of the whole head's packed weights and scales: the node and its
tensors are the ones MatMulNBitsQuantizer writes, byte for byte, and at most a block of float32 rows is in memory.
The head's float weight stays in the data file (np.memmap: page cache, not the process's memory) until the graph is
written back without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, helper

BLOCK_BYTES = 64 << 20  # float32 bytes of head rows quantized at a time


def head_node(model: onnx.ModelProto, output: str) -> onnx.NodeProto | None:
    """The MatMul (weight [K, N]) or Gemm (transB: weight [N, K]) that produces graph output `output` (the logits),
    through casts and a logit soft-capping (quantize.producer_matmul's walk), with a constant float32 2-D weight in
    the data file (external); None otherwise (the caller quantizes the head in the graph)."""
    by_out = {o: n for n in model.graph.node for o in n.output}
    node = by_out.get(output)
    while node is not None and node.op_type in ("Cast", "Identity", "Div", "Tanh", "Mul"):
        node = by_out.get(node.input[0])
    if node is None or node.op_type not in ("MatMul", "Gemm") or len([i for i in node.input if i]) != 2:
        return None
    if node.op_type == "Gemm":  # (gemm_to_matmul's condition, transB set)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 \
                or not attrs.get("transB", 0):
            return None
    init = next((i for i in model.graph.initializer if i.name == node.input[1]), None)
    if init is None or len(init.dims) != 2 or init.data_type != onnx.TensorProto.FLOAT \
            or not external_data_helper.uses_external_data(init):
        return None
    return node


def quantize_head(model: onnx.ModelProto, node: onnx.NodeProto, folder: Path, bits: int, block_size: int,
                  accuracy_level: int | None) -> str:
    """Replace head_node's node by MatMulNBits(bits, symmetric) in place, its weight read from its data file in
    folder a block of rows at a time; the float weight's initializer is dropped (the model's other external tensors
    stay as they are). Returns the new node's name. The names are the ones gemm_to_matmul + MatMulNBitsQuantizer
    give: a Gemm's weight W becomes W_kn, then W_kn_Q{bits} / W_kn_scales, the node <name>_Q{bits}."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    g = model.graph
    k_of = {i.name: k for k, i in enumerate(g.initializer)}
    init = g.initializer[k_of[node.input[1]]]
    info = {e.key: e.value for e in init.external_data}
    gemm = node.op_type == "Gemm"
    shape = tuple(int(d) for d in init.dims)
    n, k = shape if gemm else shape[::-1]
    weight = np.memmap(Path(folder) / info["location"], dtype=np.float32, mode="r",
                       offset=int(info.get("offset", 0)), shape=shape)
    k_blocks = -(-k // block_size)
    blob = block_size * bits // 8
    packed = np.zeros((n, k_blocks, blob), np.uint8)
    scales = np.zeros((n, k_blocks), np.float32)
    zero_points = np.zeros((n, (k_blocks + 8 // bits - 1) // (8 // bits)), np.uint8)  # (unused: symmetric)
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    step = max(1, BLOCK_BYTES // (4 * k))
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        rows = np.ascontiguousarray(weight[n0:n1].T if gemm else weight[:, n0:n1])  # [K, rows]
        if k_blocks * block_size != k:
            rows = np.pad(rows, ((0, k_blocks * block_size - k), (0, 0)))
        p, sc, zp = packed[n0:n1].copy(), scales[n0:n1].copy(), zero_points[n0:n1].copy()
        kernel(p, rows, sc, zp, block_size, n1 - n0, k, True)
        packed[n0:n1], scales[n0:n1] = p, sc
    del weight
    name = node.input[1] + ("_kn" if gemm else "")
    q = onnx.numpy_helper.from_array(packed, f"{name}_Q{bits}")
    s = onnx.numpy_helper.from_array(scales, f"{name}_scales")
    del g.initializer[k_of[node.input[1]]]
    g.initializer.extend([q, s])
    old = node.name if not gemm else (node.name or node.output[0] + "_matmul")
    attrs = dict(K=k, N=n, bits=bits, block_size=block_size, **({"accuracy_level": accuracy_level}
                                                                 if accuracy_level else {}))
    new = helper.make_node("MatMulNBits", [node.input[0], q.name, s.name], [node.output[0]],
                           name=f"{old}_Q{bits}" if old else "", domain="com.microsoft", **attrs)
    at = list(g.node).index(node)
    g.node.remove(node)
    g.node.insert(at, new)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return old
