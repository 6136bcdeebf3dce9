"""Block-wise int4 weights for the HTP target's QDQ graphs (`--target htp --quant decode=w4a16` / `w4a16o`).

onnxruntime.quantization's QNN config quantizes int4 weights per channel (one scale per output), too coarse
for a real decoder (docs/precisions.md). The graphs are quantized at 8 bits; this pass then re-makes each chosen
MatMul / Gemm weight int4 block-wise along the input dimension (BLOCK inputs per scale: `DequantizeLinear` with
`block_size`, opset 21). The int32 bias keeps its own encoding (its float values do not change). The QNN EP
compiles this form for the HTP (checked on its simulator, with `enable_block_quant_weight_optimization` left at 0:
a block-wise Gemm with its bias matched numpy on the de-quantized weights to 0.02 of 37).

* w4a16: symmetric, round to nearest, scale = max |w| / 7 per block (`blockwise`).
* w4a16o: GGUF Q4_1's rule (w ≈ d·q + m per block, export/cpu/offsets.py's q4_min_max), which the QNN EP
  cannot take as a zero point (it refuses block-wise DequantizeLinear with one, and -m/d is not an integer).
  `offsets_decompose` rewrites the float graph first, x·W = x·(d(q − 8)) + (x·E)·C with E [K, nb] the block
  indicator and C = m + 8d [nb, N]: the main term is exactly symmetric int4 (scale d, values q − 8), E is exact
  in int4 (scale 1), C stays an 8-bit weight, x·E (the block sums) a 16-bit activation. Weights that were a
  Q4_1 GGUF (the real SmolLM2-135M decoder) come back without loss.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..cpu import offsets as quantize_offsets

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


def weight_axes(model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
    """Constant rank-2 weight name -> (the MatMul / Gemm node's name, the axis of its input dimension)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    out = {}
    for n in g.node:
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or n.input[1] not in inits:
            continue
        if len(inits[n.input[1]].dims) != 2:
            continue
        trans = next((a.i for a in n.attribute if a.name == "transB"), 0) if n.op_type == "Gemm" else 0
        out[n.input[1]] = (n.name, 1 if trans else 0)
    return out


def offsets_decompose(model: onnx.ModelProto, exclude: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Float graph: every MatMul / Gemm with a constant [K, N] weight (K a multiple of BLOCK, node not in exclude) as
    x·(d(q − 8)) + (x·E)·C (module doc). Returns the exact int4 grids {weight name: (values as int8, block scales)}
    for requantize (the main weights and the E matrices)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    axes = weight_axes(model)
    grids: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    nodes = []
    for node in g.node:
        nodes.append(node)
        wname = node.input[1] if len(node.input) > 1 else None
        if wname not in axes or node.name in exclude or inits[wname].data_type != onnx.TensorProto.FLOAT:
            continue
        axis = axes[wname][1]
        w = numpy_helper.to_array(inits[wname])
        w_kn = w if axis == 0 else w.T
        k, n = w_kn.shape
        if k % BLOCK:
            continue
        q, d, m = quantize_offsets.q4_min_max(w_kn)  # q [N, nb, 32], d / m [N, nb]
        nb = k // BLOCK
        qs = (q.astype(np.int8) - 8).reshape(n, k).T  # [K, N], -8..7
        sym = (qs.reshape(nb, BLOCK, n) * d.T[:, None, :]).reshape(k, n).astype(np.float32)
        base = node.name or node.output[0]
        sname, ename, cname = f"{wname}_sym", f"{base}_block_ones", f"{base}_block_offsets"
        e = np.zeros((k, nb), np.int8)
        e[np.arange(k), np.arange(k) // BLOCK] = 1
        c = np.ascontiguousarray((m + 8 * d).T).astype(np.float32)  # [nb, N]
        g.initializer.extend([numpy_helper.from_array(sym if axis == 0 else np.ascontiguousarray(sym.T), sname),
                              numpy_helper.from_array(e.astype(np.float32), ename), numpy_helper.from_array(c, cname)])
        grids[sname] = (qs if axis == 0 else np.ascontiguousarray(qs.T), np.ascontiguousarray(d.T if axis == 0 else d))
        grids[ename] = (e, np.ones((nb, nb), np.float32))
        y = node.output[0]
        node.input[1] = sname
        node.output[0] = f"{base}_sym_out"
        nodes += [helper.make_node("MatMul", [node.input[0], ename], [f"{base}_block_sums"], name=f"{base}_block_sums"),
                  helper.make_node("MatMul", [f"{base}_block_sums", cname], [f"{base}_offsets_out"], name=f"{base}_offsets"),
                  helper.make_node("Add", [f"{base}_sym_out", f"{base}_offsets_out"], [y], name=f"{base}_offsets_add")]
    del g.node[:]
    g.node.extend(nodes)
    drop_unused(g)
    return grids


def drop_unused(g: onnx.GraphProto) -> None:
    """Remove the initializers no node reads, in place (a rebuilt list would copy every weight kept: ~2 GB more at a
    1B decoder)."""
    used = {x for n in g.node for x in n.input}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]


def requantize(model: onnx.ModelProto, floats: dict[str, np.ndarray], grids: dict | None = None,
               block: int = BLOCK) -> int:
    """Every DequantizeLinear of a rank-2 initializer `<w>_quantized` that is a MatMul's or Gemm's weight, for w in
    floats (the weight before quantization: symmetric blockwise) or in grids (exact int4 values and block scales), is
    re-made int4 block-wise; returns how many were. A weight whose input dimension is not a multiple of block stays
    as the quantizer made it."""
    grids = grids or {}
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
        if init is None or len(init.dims) != 2:
            continue
        name, axis = qname.removesuffix("_quantized"), axis_of[node.output[0]]
        if name in grids:
            q, scale = grids[name]
        else:
            w = floats.get(name)
            if w is None or w.shape != tuple(init.dims) or w.shape[axis] % block:
                continue
            q, scale = blockwise(w.astype(np.float32), axis, block)
        init.CopyFrom(helper.make_tensor(qname, onnx.TensorProto.INT4, list(q.shape), q.flatten().tolist()))
        sname = qname + "_block_scale"
        g.initializer.append(numpy_helper.from_array(scale.astype(np.float32), sname))
        del node.input[:]
        node.input.extend([qname, sname])  # symmetric: no zero point
        keep = [a for a in node.attribute if a.name not in ("axis", "block_size")]
        del node.attribute[:]
        node.attribute.extend(keep + [helper.make_attribute("axis", axis), helper.make_attribute("block_size", block)])
        done += 1
    drop_unused(g)  # the per-channel scales and zero points it replaced
    return done


def float_weights(model: onnx.ModelProto, exclude: set[str] = frozenset()) -> dict[str, np.ndarray]:
    """The rank-2 float MatMul / Gemm weights of a (float) model, by name, except those of the nodes in exclude."""
    axes = weight_axes(model)
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
            if i.data_type == onnx.TensorProto.FLOAT and i.name in axes and axes[i.name][0] not in exclude}
