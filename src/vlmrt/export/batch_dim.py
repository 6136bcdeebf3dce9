"""A batch of sequences through the one-graph gqa_in_place decoder: B = the length of its seqlens_k input.

The exported graph runs its layers on x [1, ar, hidden] (families/layers.py: gqa_in_place enters with x[None] and
leaves with x[0]). `add_batch_dim` makes the leading 1 the batch: the enter Unsqueeze becomes a Reshape to
[B, ar / B, hidden] (as do rows added inside the stack: DeepStack's), GroupQueryAttention's position_ids [1, ar] (the
graph's position input, or with M-RoPE the token indices into the step's own rotary table: families/layers.py
_gqa_rope) are reshaped to [B, ar / B], the leave Gather becomes a Flatten back to [ar, width], views baked as
[1, -1, ...] keep the input's dim 0, and the cache buffers' first dimension is symbolic (`batch`), as are a conv
layer's (LFM2: its window past_conv_i [B, width, channels] and its rows new_conv_i [B, ar / B, channels]).
GroupQueryAttention already takes B sequences, each with its own seqlens_k[b] (its step's last slot) over its own
buffer rows [b, kv_heads, max_context, head_dim]; a conv layer's depthwise Conv runs over each sequence's window and
rows; every other node works row by row, so one call advances B sequences of ar / B tokens each (the batched decode
step: B sequences of one token, ar = B). B = 1 computes what the graph computed before, node for node (a Reshape to the
Unsqueeze's shape), so the one-sequence engine is unchanged.

    n = add_batch_dim(model, seqlens="seqlens_k")   # -> the GroupQueryAttention nodes
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

BATCH = "batch"


def add_batch_dim(model: onnx.ModelProto, seqlens: str, cache_prefixes=("past_", "present_", "new_conv_")) -> int:
    """Rewrites model in place (see the module doc); returns how many GroupQueryAttention nodes now take the batch.
    Raises ValueError when the graph is not the gqa_in_place decoder's shape (one Unsqueeze into the layers, one
    Gather out)."""
    g = model.graph
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    if not gqa:
        raise ValueError("no GroupQueryAttention node: not a gqa_in_place decoder graph")
    hidden = _hidden(g)
    inits = {i.name: i for i in g.initializer}
    # the enter: the one Unsqueeze(axes [0]) whose output the first layer's norm reads, or where that norm is not
    # fused (fp16: its input is Cast first), the Unsqueeze of inputs_embeds itself
    unsqueeze = [n for n in g.node if n.op_type == "Unsqueeze" and _const(inits, n.input[1]) == [0]]
    enter = [n for n in unsqueeze
             if any(c.op_type == "SimplifiedLayerNormalization" for c in consumers.get(n.output[0], []))]
    enter = enter or [n for n in unsqueeze if n.input[0] == g.input[0].name]
    # the leave: Gather(x, 0) on axis 0 of the last residual sum
    leave = [n for n in g.node if n.op_type == "Gather" and _const(inits, n.input[1]) == 0
             and _attr(n, "axis", 0) == 0 and n.input[0] not in inits]
    if len(enter) != 1 or len(leave) != 1:
        raise ValueError(f"expected one enter Unsqueeze and one leave Gather, found {len(enter)} and {len(leave)}")
    # rows added to the hidden rows inside the stack (DeepStack's row input after a layer): [ar, hidden] -> [1, ...]
    rows_in = [n for n in unsqueeze if n is not enter[0] and consumers.get(n.output[0])
               and all(c.op_type == "Add" for c in consumers[n.output[0]])]
    positions = {n.input[9] for n in gqa}
    if len(positions) != 1:
        raise ValueError(f"the GroupQueryAttention nodes read {len(positions)} position_ids tensors, not one")
    (positions,) = positions
    add = [
        helper.make_node("Shape", [seqlens], ["batch_dim.b"], name="batch_dim.shape"),  # [1] int64: B
        helper.make_node("Concat", ["batch_dim.b", "batch_dim.minus1", "batch_dim.hidden"], ["batch_dim.x_shape"],
                         name="batch_dim.x_shape", axis=0),
        helper.make_node("Concat", ["batch_dim.b", "batch_dim.minus1"], ["batch_dim.p_shape"],
                         name="batch_dim.p_shape", axis=0),
        helper.make_node("Reshape", [positions, "batch_dim.p_shape"], ["batch_dim.positions"], name="batch_dim.positions"),
    ]
    g.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), "batch_dim.minus1"),
                          numpy_helper.from_array(np.array([hidden], np.int64), "batch_dim.hidden")])
    lv = leave[0]
    for n in (enter[0], *rows_in):
        n.op_type, n.input[1] = "Reshape", "batch_dim.x_shape"  # [ar, hidden] -> [B, ar / B, hidden]
    old_index = lv.input[1]
    lv.op_type = "Flatten"  # [B, ar / B, width] -> [ar, width] (the stack's width: Gemma 4's input rows are wider)
    del lv.input[1:]
    del lv.attribute[:]
    lv.attribute.append(helper.make_attribute("axis", 2))
    for n in gqa:
        n.input[9] = "batch_dim.positions"  # position_ids [B, ar / B]
    if not any(old_index in n.input for n in g.node):
        keep = [i for i in g.initializer if i.name != old_index]
        del g.initializer[:]
        g.initializer.extend(keep)
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(add + nodes)  # (they read seqlens_k and constants only)
    for v in (*g.input, *g.output):
        if v.name.startswith(cache_prefixes):
            dims = v.type.tensor_type.shape.dim
            dims[0].Clear()
            dims[0].dim_param = BATCH
            if v.name.startswith("new_conv_"):  # a conv layer's rows [B, ar / B, channels]
                dims[1].Clear()
                dims[1].dim_param = "ar / batch"
    _views_keep_batch(g)
    _drop_batch_hints(g)
    seq = next(v for v in g.input if v.name == seqlens)
    d = seq.type.tensor_type.shape.dim[0]
    d.Clear()
    d.dim_param = BATCH
    return len(gqa)


def _views_keep_batch(g) -> None:
    """A view of a [1, ar, ...] tensor inside the layers (per-head q/k norms: [1, ar, h*d] <-> [1, ar, h, d]) is a
    Reshape whose shape the exporter bakes as [1, -1, ...]: it becomes [0, -1, ...] (Reshape's 0 copies the input's
    dim 0, the batch, with allowzero 0), which for B = 1 is the same shape."""
    first = {v.name: v.type.tensor_type.shape.dim[0] for v in g.value_info if len(v.type.tensor_type.shape.dim)}
    inits = {i.name: i for i in g.initializer}
    replaced = set()
    for n in g.node:
        shape = _const(inits, n.input[1]) if n.op_type == "Reshape" else None
        dim = first.get(n.input[0])
        if not shape or shape[:2] != [1, -1] or 0 in shape or dim is None or dim.dim_value != 1:
            continue
        for a in n.attribute:  # (the exporter's allowzero=1: a 0 would be a zero-sized dim)
            if a.name == "allowzero":
                a.i = 0
        name = f"batch_dim.{n.input[1]}"
        if name not in inits:
            inits[name] = numpy_helper.from_array(np.array([0, *shape[1:]], np.int64), name)
            g.initializer.append(inits[name])
        replaced.add(n.input[1])
        n.input[1] = name
    used = {i for n in g.node for i in n.input}
    keep = [i for i in g.initializer if i.name not in replaced or i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def _drop_batch_hints(g) -> None:
    """The exporter's value_info of the layers' tensors [1, ar, ...] (and derived: a conv's [1, hidden, width + ar])
    would be stale for B > 1 and ORT would hold a graph output computed from them to the 1 (a conv layer's rows):
    those whose dim 0 is 1 are dropped, for ORT to infer."""
    def stale(v):
        dims = v.type.tensor_type.shape.dim
        return bool(dims) and dims[0].dim_value == 1

    keep = [v for v in g.value_info if not stale(v)]
    del g.value_info[:]
    g.value_info.extend(keep)


def _hidden(g) -> int:
    x = g.input[0]  # inputs_embeds [ar, hidden]
    return x.type.tensor_type.shape.dim[1].dim_value


def _const(inits, name):
    t = inits.get(name)
    return None if t is None else numpy_helper.to_array(t).tolist()


def _attr(node, name, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)
