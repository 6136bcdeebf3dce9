"""Block-wise int4 weights for the HTP target's QDQ decoder graphs (`--htp-weights 4`).

onnxruntime.quantization's QNN config quantizes int4 weights per channel (one scale per output), too coarse
for a real decoder (docs/precisions.md). This pass re-quantizes every int4 weight of a MatMul / Gemm from its
float original block-wise along the input dimension (symmetric, BLOCK inputs per scale: `DequantizeLinear`
with `block_size`, opset 21). The int32 bias keeps its own encoding (its float values do not change). The QNN
EP compiles this form for the HTP (checked on its simulator, with `enable_block_quant_weight_optimization`
left at 0: a block-wise Gemm with its bias matched numpy on the de-quantized weights to 0.02 of 37).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

BLOCK = 32


def blockwise(w: np.ndarray, axis: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] (axis 0) or [N, K] (axis 1), blocks along K -> (int4 values as int8, same shape; scales with K / block
    on that axis). Symmetric, round to nearest, scale = max |w| / 7 per block, values clipped to -8..7."""
    wt = w if axis == 0 else w.T  # [K, N]
    k, n = wt.shape
    wb = wt.reshape(k // block, block, n)
    scale = np.abs(wb).max(axis=1) / 7.0  # [K / block, N]
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(wb / scale[:, None, :]), -8, 7).astype(np.int8).reshape(k, n)
    return (q, scale) if axis == 0 else (np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T))


def requantize(model: onnx.ModelProto, floats: dict[str, np.ndarray], block: int = BLOCK) -> int:
    """Every DequantizeLinear of a rank-2 INT4 initializer `<w>_quantized` that is a MatMul's or Gemm's weight is
    re-made block-wise from floats[<w>] (the weight before quantization); returns how many were. A weight whose
    input dimension is not a multiple of block stays per channel."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    axis_of = {}  # DQ output -> the axis of the weight's input dimension
    for n in g.node:
        if n.op_type == "MatMul":
            axis_of[n.input[1]] = 0
        elif n.op_type == "Gemm":
            trans = next((a.i for a in n.attribute if a.name == "transB"), 0)
            axis_of[n.input[1]] = 1 if trans else 0
    done = 0
    for node in g.node:
        if node.op_type != "DequantizeLinear" or node.output[0] not in axis_of:
            continue
        qname = node.input[0]
        init = inits.get(qname)
        if init is None or init.data_type != onnx.TensorProto.INT4 or len(init.dims) != 2:
            continue
        w = floats.get(qname.removesuffix("_quantized"))
        axis = axis_of[node.output[0]]
        if w is None or w.shape != tuple(init.dims) or w.shape[axis] % block:
            continue
        q, scale = blockwise(w.astype(np.float32), axis, block)
        init.CopyFrom(helper.make_tensor(qname, onnx.TensorProto.INT4, list(q.shape), q.flatten().tolist()))
        sname = qname + "_block_scale"
        g.initializer.append(numpy_helper.from_array(scale, sname))
        del node.input[:]
        node.input.extend([qname, sname])  # symmetric: no zero point
        keep = [a for a in node.attribute if a.name not in ("axis", "block_size")]
        del node.attribute[:]
        node.attribute.extend(keep + [helper.make_attribute("axis", axis), helper.make_attribute("block_size", block)])
        done += 1
    used = {x for n in g.node for x in n.input}
    keep = [i for i in g.initializer if i.name in used]  # the per-channel scales and zero points it replaced
    del g.initializer[:]
    g.initializer.extend(keep)
    return done


def float_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The rank-2 float initializers of a (float) model, by name."""
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
            if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2}
