"""The lm head at 4 bits with its top candidates re-scored from 8-bit rows (`lm_head=w4a8r`, `w4a16r`).

The head is the decoder's largest MatMul (SmolLM2: 576 -> 49,152) and every logit is read once per token: at 8 bits
it costs a 4-bit decoder ~10 % of its step, at 4 bits it loses the top-1 token (docs/precisions.md). A 4-bit head
ranks well enough to find the candidates, not to pick among near-ties, so the graph does both:

    raw = MatMulNBits(hidden)                      [.., vocab]  the 4-bit head (symmetric, as w4a8's / w4a16's)
    idx = TopK(raw, TOP)                           [.., TOP]    its best TOP tokens
    exact = (int8 rows[idx] · hidden) · scale[idx]  [.., TOP]    those logits from per-row int8 weights, float compute
    logits = ScatterElements(raw, idx, exact)      [.., vocab]  the TOP candidates' logits replaced

The greedy token (the graph's ArgMax of logits) is then the best of the candidates by the 8-bit rows: the 8-bit
head's choice whenever that is among the 4-bit head's TOP (measured: docs/precisions.md). Logits outside the
candidates stay the 4-bit head's, so a sampler sees those to 4-bit accuracy. The rows are the head's weights
per-row int8 (quantize.int8_rows, as the host's embedding table); one step reads TOP rows of them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

TOP = 8


def rescore(model: onnx.ModelProto, logits: str, rows: np.ndarray, scales: np.ndarray) -> None:
    """Rewrite model so that output `logits`, produced by the 4-bit head MatMulNBits, is that head's output with its
    TOP best entries re-scored from the head's weights as per-row int8: rows [vocab, K] int8, scales [vocab] float32
    (quantize.int8_rows of the weights [vocab, K]; module doc)."""
    g = model.graph
    head = next(n for n in g.node if logits in n.output)
    if head.op_type != "MatMulNBits":
        raise ValueError(f"the lm head producing {logits!r} is a {head.op_type}, not MatMulNBits")
    raw, hidden = f"{logits}_4bit", head.input[0]
    head.output[list(head.output).index(logits)] = raw
    p = "lm_head_rescore"
    g.initializer.extend([
        numpy_helper.from_array(rows, f"{p}_rows"), numpy_helper.from_array(scales, f"{p}_scales"),
        numpy_helper.from_array(np.array([TOP], np.int64), f"{p}_k"),
        numpy_helper.from_array(np.array([-1], np.int64), f"{p}_last"),
    ])
    g.node.extend([
        helper.make_node("TopK", [raw, f"{p}_k"], [f"{p}_top", f"{p}_idx"], name=f"{p}_topk", axis=-1),  # [.., TOP]
        helper.make_node("Gather", [f"{p}_rows", f"{p}_idx"], [f"{p}_r8"], name=f"{p}_gather", axis=0),  # [.., TOP, K]
        helper.make_node("Cast", [f"{p}_r8"], [f"{p}_rf"], name=f"{p}_cast", to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [hidden, f"{p}_last"], [f"{p}_col"], name=f"{p}_col"),  # [.., K, 1]
        helper.make_node("MatMul", [f"{p}_rf", f"{p}_col"], [f"{p}_dot1"], name=f"{p}_dot"),  # [.., TOP, 1]
        helper.make_node("Squeeze", [f"{p}_dot1", f"{p}_last"], [f"{p}_dot"], name=f"{p}_squeeze"),  # [.., TOP]
        helper.make_node("Gather", [f"{p}_scales", f"{p}_idx"], [f"{p}_s"], name=f"{p}_gather_scales", axis=0),
        helper.make_node("Mul", [f"{p}_dot", f"{p}_s"], [f"{p}_exact"], name=f"{p}_scale"),
        helper.make_node("ScatterElements", [raw, f"{p}_idx", f"{p}_exact"], [logits], name=f"{p}_scatter", axis=-1),
    ])
