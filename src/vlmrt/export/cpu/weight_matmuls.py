"""The constant-weight MatMuls of a graph, each replaced by the nodes a 4-bit rule builds for it (the block-offset
rule of quantize_offsets.py, GPTQ's zero-point rule of quantize_gptq.py)."""

from __future__ import annotations

import onnx
from onnx import numpy_helper


def rewrite_weight_matmuls(model: onnx.ModelProto, exclude: set[str], precisions: str, rule) -> list:
    """model's nodes with every MatMul by a 2-D constant weight, not named in exclude, replaced by
    rule(node, weight name, weight [K, N]) -> (nodes, initializers); the initializers are appended to the graph, and
    the caller sets the nodes and drops the weights no node reads (quantize.set_nodes). precisions: the rule's
    --quant names, for the error on a weight that is not float32."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes = []
    for node in g.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if w is None or node.name in exclude or len(w.dims) != 2:
            nodes.append(node)
            continue
        if w.data_type != onnx.TensorProto.FLOAT:  # the rules' scales, offsets and products are float32
            raise ValueError(f"--quant {precisions} take float32 graphs only (not --dtype fp16)")
        new, new_inits = rule(node, w.name, numpy_helper.to_array(w))
        nodes += new
        g.initializer.extend(new_inits)
    return nodes
