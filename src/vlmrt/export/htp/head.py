"""The lm head as its own HTP graph (`--quant head=w8a16`, QHexRT's "lm-head W8A16 as its own graph").

    decoder graph:  ... -> final norm -> hidden [ar, hidden_size]            (decoder.hidden_output)
    head graph:     hidden [1, hidden_size] -> lm head MatMul / Gemm -> logits [1, vocab]

The runtime runs the head on the step's last valid row only (runtime/decode/step.py), so the head graph is static at one
row, is compiled to its own context binary at its own precision, and its weight (the largest one of a small model)
is not copied into both decoder binaries. It is calibrated on the float decoder's hidden states of the decode calls
recorded for the decoder graphs' own calibration.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from . import precisions as htp_precisions
from .. import onnx_names
from .calibrate import list_reader

HIDDEN = "hidden"  # the decoder graphs' output and the head graph's input (manifest decoder.hidden_output)
TAIL = ("Cast", "Identity", "Add", "Reshape", "Squeeze", "Unsqueeze")  # htp_precisions.head_node walks these too


def head_nodes(model: onnx.ModelProto, logits: str) -> tuple[list[onnx.NodeProto], str]:
    """The nodes from the lm head MatMul / Gemm to output `logits` (in graph order) and the head's input tensor."""
    by_out = {o: n for n in model.graph.node for o in n.output}
    chain, node = [], by_out[logits]
    while node.op_type in TAIL:
        chain.append(node)
        node = by_out[node.input[0]]
    chain.append(node)  # the MatMul / Gemm (htp_precisions.head_node checked it)
    consts = {i.name for i in model.graph.initializer} | {c.output[0] for c in chain}
    for n in chain:  # a weight, a bias Add, a Reshape's shape: constants, not other activations
        if any(i and i not in consts for i in n.input[1:]):
            raise ValueError(f"the lm head's {n.op_type} {n.name!r} reads a non-constant input")
    return chain[::-1], node.input[0]


def split(model: onnx.ModelProto, logits: str, hidden_size: int, vocab: int) -> onnx.ModelProto:
    """Cut the decoder graph `model` (in place) after its final norm: its output `logits` becomes HIDDEN; returns
    the head graph [1, hidden_size] -> logits [1, vocab] with the head's weights."""
    htp_precisions.head_node(model, logits)  # raises if there is no recognisable head
    chain, src = head_nodes(model, logits)
    g = model.graph
    used = {i for n in chain for i in n.input}
    head_inits = [onnx.TensorProto.FromString(i.SerializeToString()) for i in g.initializer if i.name in used]
    keep = [n for n in g.node if not any(n is c for c in chain)]
    still = {i for n in keep for i in n.input}
    del g.node[:]
    g.node.extend(keep)
    onnx_names.rename_tensor(g, src, HIDDEN)  # the norm's output is named HIDDEN
    out = next(o for o in g.output if o.name == logits)
    ar = out.type.tensor_type.shape.dim[0].dim_value
    out.CopyFrom(helper.make_tensor_value_info(HIDDEN, onnx.TensorProto.FLOAT, [ar, hidden_size]))
    gone = [i for i in g.initializer if i.name in used and i.name not in still]
    for i in gone:
        g.initializer.remove(i)
    gone_t = {o for n in chain for o in n.output}  # (value_info stays: it types the fused ops' outputs)
    keep_vi = [v for v in g.value_info if v.name not in gone_t and v.name != src]
    del g.value_info[:]
    g.value_info.extend(keep_vi)
    for n in chain:
        n.input[:] = [HIDDEN if i == src else i for i in n.input]
    head = helper.make_graph(chain, "head", [helper.make_tensor_value_info(HIDDEN, onnx.TensorProto.FLOAT, [1, hidden_size])],
                             [helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, [1, vocab])],
                             head_inits)
    return helper.make_model(head, opset_imports=list(model.opset_import), ir_version=model.ir_version)


class HiddenReader:
    """Calibration feeds of the head graph: {HIDDEN: [1, hidden_size]} rows, the float decoder's final-norm output
    over the decode calls the decoder graphs were calibrated on (rec: export/htp_calibrate.Recorder of the decode graph)."""

    def __init__(self, float_decode: Path, rec, logits: str):
        import onnxruntime as ort

        model = onnx.load(str(float_decode), load_external_data=False)
        _, src = head_nodes(model, logits)
        model.graph.output.append(helper.make_tensor_value_info(src, onnx.TensorProto.FLOAT, None))
        probe = float_decode.with_name(float_decode.stem + ".hidden.onnx")  # next to its external data
        onnx.save(model, str(probe))
        try:
            s = ort.InferenceSession(str(probe), providers=["CPUExecutionProvider"])
            reader, self.rows = rec.reader(), []
            while (f := reader.get_next()) is not None:
                self.rows.extend(np.asarray(r, np.float32)[None] for r in s.run([src], f)[0])  # [ar, hidden] rows
        finally:
            probe.unlink()

    def reader(self):
        return list_reader(self.rows, lambda r: {HIDDEN: r})
